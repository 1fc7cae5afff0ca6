"""The ``ckptd`` command: ``serve`` and the commands that inspect and operate a root without the server."""
