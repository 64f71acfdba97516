"""Links from a page to files of the repository outside ``docs/`` (raw benchmark results,
``examples/``, ``CHANGELOG.md``): a MkDocs hook (``hooks:`` in ``mkdocs.yml``).

In the repository (on GitHub, in an editor) such a link is an ordinary relative link. MkDocs
knows only the files under ``docs/``, so this hook checks that each one's target exists — a
missing one fails the strict build, like any broken link — and points it at ``repo_url``'s
copy of the file when the site has one; without ``repo_url`` it becomes the file's path in
the repository, as code.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.repo_links")

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)]*)?\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config.docs_dir).resolve()
    here = (docs / page.file.src_uri).parent

    def repl(m: re.Match[str]) -> str:
        target = m.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return m.group(0)  # a URL or a site-absolute path: not ours
        path = Path(posixpath.normpath(here / target))
        if path.is_relative_to(docs) or not path.is_relative_to(ROOT):
            return m.group(0)  # a page of the site (MkDocs checks it), or outside the repository
        if not path.exists():
            log.warning("%s links to %s, which is not in the repository", page.file.src_uri, target)
            return m.group(0)
        rel = path.relative_to(ROOT).as_posix()
        if not config.repo_url:
            return f"`{rel}`"  # where to find it in a clone
        kind = "tree" if path.is_dir() else "blob"
        return f"[{m.group('text')}]({config.repo_url.rstrip('/')}/{kind}/main/{rel}{m.group('anchor') or ''})"

    return LINK.sub(repl, markdown)
