"""Talking to the ckptd sidecar over HTTP (jax-free): the resume client with its storage-scan fallback,
the event reporter and the retry policy they share. Never imports the server framework."""
