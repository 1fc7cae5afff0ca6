import sys

from ckptd.cli.main import main

sys.exit(main())
