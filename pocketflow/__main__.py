"""``python -m pocketflow``: the same command line as the ``pocketflow`` console script."""

import sys

from pocketflow.cli import main

if __name__ == "__main__":
    sys.exit(main())
