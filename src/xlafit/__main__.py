import sys

from xlafit.cli import main

if __name__ == "__main__":
    sys.exit(main())
