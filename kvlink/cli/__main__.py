"""``python -m kvlink.cli``: the ``kvlink`` command."""

import sys

from kvlink.cli import main

if __name__ == "__main__":
    sys.exit(main())
