"""The sidecar: API, auth, catalog, integrity, events, advisor, CLI."""
