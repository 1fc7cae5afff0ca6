"""The trainer library: client, event reporter, elastic runner, memory tier, restores."""
