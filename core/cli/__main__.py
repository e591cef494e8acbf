"""``python -m lmplug.cli``."""

import sys

from lmplug.cli import main

if __name__ == "__main__":
    sys.exit(main())
