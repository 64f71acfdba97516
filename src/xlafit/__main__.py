import sys

from xlafit.cli import main

sys.exit(main())
