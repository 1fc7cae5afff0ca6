"""Whole-system tests: real servers and processes, chaos, GCS emulator, deployment, the public API."""
