"""The documentation: the site builds strictly, its Python blocks run, its references are
complete, and no user-facing text narrates how the project was made.

- ``mkdocs build --strict`` (what ``make docs`` runs): a broken link, a page missing from
  the nav or an API entry naming a removed object fails here.
- Every ```` ```python ```` block of the README and of ``docs/`` runs, page by page in one
  namespace (as a reader would paste them), unless the line before it says
  ``<!-- needs: tpu -->`` or ``<!-- needs: bucket -->``. The migration guide's programs have
  their own test (``test_migration_guide.py``). MNIST is sliced to 400 digits, as there.
- Every CLI flag has help text and every config key a comment (``docs/gen_reference.py``
  generates both reference pages from them).
"""

import ast
import contextlib
import dataclasses
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from helpers import use_few_digits

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))
import gen_reference  # noqa: E402  (docs/gen_reference.py: the reference pages' generator)

OWN_TEST = {"guides/migration.md": "test_migration_guide.py"}
NEEDS = re.compile(r"<!-- needs: (tpu|bucket|a run) -->\s*$")


# --------------------------------------------------------------------------- the site


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT / "src")}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-5000:]
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "xlafit check" in cli and "--max-batch" in cli
    config = (site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    assert "trainer.nan_policy" in config and "cpu.keep_memory" in config
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "train_and_evaluate" in api and "Trainer" in api


def test_every_page_is_in_the_nav():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:", 1)[1].join(["nav:", ""]))

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)

    listed = set(pages(nav["nav"]))
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    generated = set(gen_reference.PAGES)
    assert on_disk | generated == listed


# --------------------------------------------------------------------------- the references


def test_every_cli_flag_has_help():
    assert gen_reference.flags_without_help() == []
    names = [name for name, _, _ in gen_reference.commands(gen_reference.parser())]
    assert {"train", "check", "launch", "inspect", "devices"} <= set(names)


# Config keys without a comment in the dataclasses of src/xlafit/config.py and the recipes:
# none. A new key without one fails.
KEYS_WITHOUT_HELP: set[str] = set()


def test_every_config_key_has_help():
    missing = set(gen_reference.keys_without_help())
    assert sorted(missing - KEYS_WITHOUT_HELP) == [], "give these keys a comment in their dataclass"
    assert sorted(KEYS_WITHOUT_HELP - missing) == [], "these keys have help now: take them off KEYS_WITHOUT_HELP"
    keys = {key for key, _, _, _ in gen_reference.config_keys()}
    assert {"trainer.nan_policy", "mesh.fsdp", "cpu.keep_memory", "model.remat", "data.workers"} <= keys


@dataclasses.dataclass
class _Documented:
    """A section.

    Attributes:
        described: from the docstring,
            on two lines.
    """

    trailing: int = 1  # from the comment on its line
    # from the comment lines
    # above it
    above: str = "x"
    described: float = 0.0
    bare: bool = False


def test_the_generator_reads_comments_and_attributes():
    helps = gen_reference.field_help(_Documented)
    assert helps == {
        "trailing": "from the comment on its line",
        "above": "from the comment lines above it",
        "described": "from the docstring, on two lines.",
        "bare": "",
    }


def test_exit_codes_page_lists_every_code():
    from xlafit import errors

    codes = {code for _, code, _ in gen_reference.exit_codes()}
    assert codes == {
        errors.DAMAGED,
        errors.USAGE,
        errors.NONFINITE,
        errors.BUSY,
        errors.STORAGE,
        errors.PREEMPTED,
        errors.INTERRUPTED,
    }


# --------------------------------------------------------------------------- the Python blocks


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, source, needs)`` of every ```` ```python ```` block of ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != "```python":
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        marker = NEEDS.search(lines[i - 1]) if i else None
        blocks.append((i + 1, "\n".join(lines[i + 1 : end]) + "\n", marker.group(1) if marker else None))
    return blocks


def pages_with_python() -> list[str]:
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [
        p.relative_to(DOCS).as_posix() if p.is_relative_to(DOCS) else p.name
        for p in pages
        if python_blocks(p) and p.relative_to(ROOT).as_posix().removeprefix("docs/") not in OWN_TEST
    ]


def test_the_guides_have_python_to_run():
    assert {"README.md", "getting-started/quickstart.md", "guides/own-model.md"} <= set(pages_with_python())


@pytest.mark.parametrize("page", pages_with_python())
def test_python_blocks_run(page, tmp_path, monkeypatch):
    path = ROOT / page if page == "README.md" else DOCS / page
    monkeypatch.chdir(tmp_path)  # blocks write runs/ where they run

    use_few_digits(monkeypatch)
    namespace: dict = {"__name__": "__main__"}
    ran = 0
    for line, source, needs in python_blocks(path):
        if needs:
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(source, f"{page}:{line}", "exec"), namespace)
        ran += 1
    assert ran, f"{page}: every block is marked as needing a TPU or a bucket"


# --------------------------------------------------------------------------- narration


NARRATION = [
    r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\d+(?:st|nd|rd|th))"
    r"\s+session\b",
    r"\b(?:this|that|earlier|previous|same)\s+session\b",
    r"\bsession\s*\d+",
    r"\bseed\s+0\d\d\b",
    r"\bissue\s+#?\d+\b",
    r"can_start_another",
    r"\bthis\s+(?:\S+\s+)?VM\b",
    r"\btoday's\s+(?:\S+\s+)?VM\b",
]
PATTERN = re.compile("|".join(NARRATION), re.I)


def user_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "mkdocs.yml"]
    files += sorted(p for p in DOCS.rglob("*") if p.is_file())
    files += sorted(p for p in (ROOT / "examples").rglob("*") if p.is_file())
    return files


def narration_in(text: str, name: str, first_line: int = 1) -> list[str]:
    return [
        f"{name}:{first_line + i}: {m.group(0)!r}"
        for i, line in enumerate(text.splitlines())
        for m in PATTERN.finditer(line)
    ]


def test_the_narration_check_can_fail():
    hits = narration_in("measured in the eleventh session (seed 001, issue 18) on this 2-core VM", "x")
    assert len(hits) == 4
    assert narration_in("a Colab session ends; a Kaggle session has a time limit; the next session resumes", "x") == []


def test_no_user_facing_file_narrates_how_the_project_was_made():
    hits = [h for path in user_files() for h in narration_in(path.read_text(encoding="utf-8"), path.name)]
    assert hits == []


def docstrings_and_comments(path: Path) -> list[tuple[int, str]]:
    source = path.read_text(encoding="utf-8")
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def test_no_docstring_or_comment_in_src_narrates_how_the_project_was_made():
    hits = [
        h
        for path in sorted((ROOT / "src").rglob("*.py"))
        for line, text in docstrings_and_comments(path)
        for h in narration_in(text, path.relative_to(ROOT).as_posix(), line)
    ]
    assert hits == []


# --------------------------------------------------------------------------- sizes and results


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


def test_the_performance_page_is_current_numbers_with_their_sources():
    page = DOCS / "performance.md"
    text = page.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    header = "| configuration | hardware | command | metric | peer, same run | ratio | date | commit | raw |"
    assert text.count(header) >= 5
    rows = [
        [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith(("| configuration", "|---"))
    ]
    has_git = (ROOT / ".git").exists()
    for row in rows:
        assert len(row) == 9, row
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", row[6]), row
        assert re.fullmatch(r"[0-9a-f]{7,40}", row[7]), row
        if has_git:
            known = subprocess.run(["git", "cat-file", "-e", f"{row[7]}^{{commit}}"], cwd=ROOT, capture_output=True)
            assert known.returncode == 0, f"unknown commit {row[7]}"
    for target in re.findall(r"\]\((\.\./benchmarks/results/[^)]+)\)", text):
        assert (DOCS / target).resolve().exists(), target


def test_the_docs_pages_src_names_exist():
    named = {
        (path.relative_to(ROOT).as_posix(), page)
        for path in sorted((ROOT / "src").rglob("*.py"))
        for page in re.findall(r"\bdocs/[\w/.-]+\.md\b", path.read_text(encoding="utf-8"))
    }
    assert named, "src names no documentation page"
    assert [(where, page) for where, page in sorted(named) if not (ROOT / page).exists()] == []


def test_the_spot_restart_loop_reruns_the_training_command_word_for_word():
    """The twenty-sixth walk: the Cloud TPU VM page's restart loop reran a shorter command than
    its step 5, which a resume refuses (other settings), so the loop's first rerun exited 2."""
    page = (DOCS / "getting-started" / "cloud-tpu-vm.md").read_text()
    commands = [
        " ".join(m.group(1).replace("\\\n", " ").split())
        for m in re.finditer(r'(XLAFIT_DISTRIBUTED=1 xlafit-env/bin/xlafit train [^"]*)"', page)
    ]
    assert len(commands) == 2 and commands[0] == commands[1], commands
