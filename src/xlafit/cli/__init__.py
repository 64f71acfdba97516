"""The ``xlafit`` command: parses arguments and calls the library, nothing else.

One module per command (``cli/train.py``, ``cli/check.py``, ...), each with ``register`` (its
parser) and ``run(args) -> int``. A command imports the library inside ``run``: ``xlafit
--help`` then loads no JAX, and answers at once.
"""

from xlafit.cli.entry import build_parser, configure_logging, main

__all__ = ["build_parser", "configure_logging", "main"]
