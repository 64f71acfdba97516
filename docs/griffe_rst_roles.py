"""A Griffe extension for the API reference: the docstrings of ``src/`` cross-reference in
Sphinx's style (``:class:`~xlafit.mesh.Strategy```) and mark doctest options
(``# doctest: +ELLIPSIS``), which mkdocstrings would show as they are. This turns a role into
inline code naming its target (the last part, under ``~``), and drops the doctest options
from the examples a reader sees (the doctests themselves keep them).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj):`(~?)([^`]+)`")
DOCTEST_OPTION = re.compile(r"\s*# doctest: [+-][A-Z_, +-]+$", re.M)


def _role(m: re.Match[str]) -> str:
    target = m.group(2)
    return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = DOCTEST_OPTION.sub("", ROLE.sub(_role, obj.docstring.value))
