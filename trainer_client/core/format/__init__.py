"""The on-storage and in-memory formats: what a step directory and a memory snapshot hold, and when
they may be trusted (the commit rule). Readers and writers on both sides use these modules, so a format
is defined once."""
