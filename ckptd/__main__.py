"""``python -m ckptd``: the ``ckptd`` command (ckptd/cli/_main.py)."""

import sys

from ckptd.cli._main import main

sys.exit(main())
