"""``python -m fedmtl``: the same command line as the ``fedmtl`` script."""

import sys

from .cli import main

sys.exit(main())
