"""`python -m gatelens` is the `gatelens` command."""

import sys

from gatelens.cli import main

if __name__ == "__main__":
    sys.exit(main())
