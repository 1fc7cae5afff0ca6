"""Helpers the tests share: Orbax steps written by plain Orbax, servers, emulators, fault proxies."""
