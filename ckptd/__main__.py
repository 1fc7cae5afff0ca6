"""``python -m ckptd``: the ``ckptd`` command (ckptd/cli/main.py)."""

import sys

from ckptd.cli.main import main

sys.exit(main())
