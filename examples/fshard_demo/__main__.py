"""``python -m fshard_demo``: the same program as the ``fshard-demo`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
