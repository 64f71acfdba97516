"""xlafit's messages in Python's logging: those that say what they are (``warning: ...``,
``note: ...``) print as they are written, whichever format the handler has.

The CLI sets up its own handler (:func:`xlafit.cli.configure_logging`). A program or notebook
that uses the library and configures no logging gets the handler absl installs the first time
it logs (Orbax logs through absl when it is imported): ``logging.basicConfig()``'s, whose
format would print ``WARNING:xlafit:warning: ...``. :func:`own_words_in_the_default_handler`
gives that handler :class:`OwnWordsFormatter`; a handler with any other format is left alone.
"""

from __future__ import annotations

import logging

# The prefixes of xlafit's messages that name their own kind.
OWN_WORDS = ("warning: ", "note: ")


class OwnWordsFormatter(logging.Formatter):
    """The handler's format, except for xlafit's messages that say what they are
    (``warning: ...``, ``note: ...``): those as they are written, not ``WARNING xlafit: warning: ...``.

    Example:
        >>> record = logging.LogRecord("xlafit", logging.WARNING, "", 0, "warning: %s", ("x",), None)
        >>> OwnWordsFormatter(logging.BASIC_FORMAT).format(record)
        'warning: x'
    """

    def format(self, record: logging.LogRecord) -> str:
        if record.name.split(".")[0] == "xlafit" and record.getMessage().startswith(OWN_WORDS):
            return record.getMessage()
        return super().format(record)


def own_words_in_the_default_handler() -> None:
    """Gives the root logger's handlers that have ``logging.basicConfig()``'s default format
    (absl's, or a program's own ``basicConfig()`` without a format) :class:`OwnWordsFormatter`
    with that same format: every other record prints as before."""
    for handler in logging.getLogger().handlers:
        formatter = handler.formatter
        if type(formatter) is logging.Formatter and formatter._fmt == logging.BASIC_FORMAT:
            handler.setFormatter(OwnWordsFormatter(logging.BASIC_FORMAT))
