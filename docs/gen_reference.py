"""The generated reference pages: every CLI command and flag, every config key, the exit codes.

A MkDocs hook (``hooks:`` in ``mkdocs.yml``): at each build it reads the argument parser
(:func:`xlafit.cli.build_parser`), the config dataclasses (:mod:`xlafit.config`, each
recipe's model and data sections) and :mod:`xlafit.errors`, and adds the pages
``reference/cli.md``, ``reference/config.md`` and ``reference/exit-codes.md`` to the site, so
they can never drift from the code. ``tests/test_docs.py`` uses the same readers to fail on a
flag or a config key without help text.

The help of a config key is its field's comment (on its line, or the comment lines right
above it), or its entry under ``Attributes:`` in the class docstring.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))  # document the tree this file is in, not an installed copy

PAGES = ("reference/cli.md", "reference/config.md", "reference/exit-codes.md")


# --------------------------------------------------------------------------- the command line


def parser() -> argparse.ArgumentParser:
    """The ``xlafit`` command's parser."""
    from xlafit import cli

    build = getattr(cli, "build_parser", None) or getattr(cli, "_parser")  # noqa: B009
    return build()


def commands(p: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """``(name, parser, one-line help)`` of every sub-command, in ``--help``'s order."""
    out = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, sub, helps.get(name, "")))
                out += [(f"{name} {n}", s, h) for n, s, h in commands(sub)]
    return out


def arguments(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """A parser's own arguments (not ``--help``, not its sub-command dispatch)."""
    return [
        a
        for a in p._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS
    ]


def flags_without_help() -> list[str]:
    """``"command --flag"`` for every argument with no help text."""
    return [
        f"{name} {a.option_strings[0] if a.option_strings else a.dest}"
        for name, sub, _ in commands(parser())
        for a in arguments(sub)
        if not (a.help or "").strip()
    ]


def _text(text: Any) -> str:
    """Plain text as Markdown: a ``<time>`` in a help string is not an HTML tag."""
    return str(text).replace("<", "&lt;").replace(">", "&gt;")


def _cell(text: Any) -> str:
    return _text(text).replace("|", "\\|").replace("\n", " ")


def _argument_row(a: argparse.Action) -> str:
    metavar = ""
    if a.option_strings and a.nargs != 0:
        metavar = " " + (a.metavar or (a.dest.upper() if not a.choices else "{" + ",".join(map(str, a.choices)) + "}"))
        if a.nargs == "?":
            metavar = f" [{metavar.strip()}]"
    name = ", ".join(f"`{s}{metavar}`" for s in a.option_strings) or f"`{a.metavar or a.dest}`"
    default = "" if a.default in (None, False, argparse.SUPPRESS) or a.nargs == 0 else f"`{a.default}`"
    return f"| {_cell(name)} | {_cell(a.help or '')} | {_cell(default)} |"


def cli_page() -> str:
    p = parser()
    lines = [
        "# Command line",
        "",
        "Generated from the `xlafit` command's argument parser at every build of these pages:",
        "what `xlafit COMMAND --help` prints. `python -m xlafit` is the same command.",
        "",
        "Overrides are dotted `key.sub=value` pairs, parsed as YAML scalars; the keys are on the",
        "[configuration](config.md) page.",
        "",
    ]
    for name, sub, summary in commands(p):
        lines += [f"## `xlafit {name}`", ""]
        summary = summary[:1].upper() + summary[1:]
        description = sub.description or ""
        if summary and not description.lower().startswith(summary.rstrip(".").lower()):
            lines += [_text(summary) + ("" if summary.endswith(".") else "."), ""]
        if description:
            lines += [_text(description), ""]
        first, *rest = sub.format_usage().removeprefix("usage: ").rstrip().splitlines()
        usage = "\n".join([first, *(line[len("usage: ") :] for line in rest)])
        lines += ["```text", usage, "```", ""]
        rows = arguments(sub)
        if rows:
            lines += ["| argument | meaning | default |", "|---|---|---|", *map(_argument_row, rows), ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the config


INTRO = "explained in the section's text above"


def field_help(cls: type) -> dict[str, str]:
    """Each dataclass field's help: its comment, its entry under ``Attributes:``, or, for a key
    the class docstring explains by name (````global_batch````), a pointer to that text. The
    bases are walked, so inherited fields keep their text."""
    helps: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        named = set(re.findall(r"``(\w+)``", klass.__doc__ or ""))
        helps.update({f.name: INTRO for f in dataclasses.fields(klass) if f.name in named})
        helps.update(_attributes_section(klass.__doc__ or ""))
        helps.update({k: v for k, v in _comments(klass).items() if v})
    return {f.name: helps.get(f.name, "") for f in dataclasses.fields(cls)}


def _attributes_section(doc: str) -> dict[str, str]:
    doc = inspect.cleandoc(doc)
    match = re.search(r"^Attributes:\n((?:[ \t]+.*\n?|\n)+)", doc, re.M)
    if not match:
        return {}
    out: dict[str, str] = {}
    name = None
    for line in textwrap.dedent(match.group(1)).splitlines():
        entry = re.match(r"(\w+)(?: \(.*?\))?: (.*)", line)
        if entry:
            name, out[entry.group(1)] = entry.group(1), entry.group(2).strip()
        elif name and line.strip():
            out[name] += " " + line.strip()
    return out


def _comments(klass: type) -> dict[str, str]:
    """Field name -> its trailing comment, or the block of comment lines right above it."""
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        row = node.lineno
        above = []
        previous = row - 1
        while previous in comments and lines[previous - 1].lstrip().startswith("#"):
            above.insert(0, comments[previous])
            previous -= 1
        parts = [*above, comments.get(node.end_lineno or row, "")]
        out[node.target.id] = " ".join(p for p in parts if p)
    return out


def _type_name(tp: Any) -> str:
    from xlafit.config import type_name

    return type_name(tp)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value).lower()


def sections() -> list[tuple[str, type]]:
    """``(key prefix, dataclass)`` of every config section: the shared ones, then each
    recipe's ``model`` section and ``data`` section (its own keys added to the shared ones)."""
    from xlafit import config
    from xlafit.recipes import RECIPES, get_recipe

    shared = []
    for f in dataclasses.fields(config.Config):
        tp = typing.get_type_hints(config.Config)[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            shared.append((f.name, tp))
    per_recipe = []
    for name in RECIPES:
        recipe = get_recipe(name)
        per_recipe.append((f"model ({name})", recipe.model_config))
        hints = typing.get_type_hints(recipe.model_config)
        for f in dataclasses.fields(recipe.model_config):  # a nested section: model.preference
            if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name]):
                per_recipe.append((f"model.{f.name} ({name})", hints[f.name]))
        if recipe.data_config is not config.DataConfig:
            per_recipe.append((f"data ({name})", recipe.data_config))
    return shared + per_recipe


def _own_fields(cls: type) -> list[dataclasses.Field]:
    """The fields ``cls`` adds to its dataclass bases (a recipe's data section lists only its
    own keys; the shared ones are under ``data``)."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    return [f for f in dataclasses.fields(cls) if f.name not in inherited]


def config_keys() -> list[tuple[str, type, dataclasses.Field, str]]:
    """``(dotted key, section class, field, help)`` of every config key."""
    out = []
    for prefix, cls in sections():
        helps = field_help(cls)
        for f in _own_fields(cls):
            out.append((f"{prefix.split(' ')[0]}.{f.name}", cls, f, helps[f.name]))
    return out


def keys_without_help() -> list[str]:
    """``"Section.key"`` for every config key with no comment and no ``Attributes:`` entry."""
    return sorted({f"{cls.__name__}.{f.name}" for _, cls, f, help_ in config_keys() if not help_})


def config_page() -> str:
    lines = [
        "# Configuration",
        "",
        "Generated from the config dataclasses at every build of these pages. A run's config is a",
        "recipe's YAML preset with dotted overrides on top (`xlafit train mnist trainer.epochs=3`);",
        "`xlafit config RECIPE` prints it resolved, and a run writes it to `config.yaml`. An unknown",
        "key, a value of the wrong type or an impossible value stops the run before any device is",
        'touched, naming the valid keys or the fix. `null` means "decided by the recipe or the data".',
        "",
    ]
    hints: dict[type, dict[str, Any]] = {}
    for prefix, cls in sections():
        hints.setdefault(cls, typing.get_type_hints(cls))
        section = prefix.split(" ")[0]
        title = f"`{section}`" + (f" — the `{prefix.split('(')[1].rstrip(')')}` recipe" if "(" in prefix else "")
        lines += [f"## {title}", ""]
        doc = inspect.cleandoc(cls.__doc__ or "")
        if doc and not doc.startswith(cls.__name__ + "("):  # dataclasses' generated signature is no help
            intro = re.split(r"^Attributes:$", doc, flags=re.M)[0].strip()
            lines += [intro.replace(":class:", "").replace(":mod:", "").replace(":func:", ""), ""]
        if "(" in prefix and section == "data":
            lines += ["These keys come in addition to the shared [`data`](#data) keys.", ""]
        helps = field_help(cls)
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in _own_fields(cls):
            tp = _type_name(hints[cls][f.name])
            lines.append(
                f"| `{section}.{f.name}` | {_cell(tp)} | `{_cell(_default(f))}` | {_cell(helps[f.name] or '-')} |"
            )
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- exit codes


def exit_codes() -> list[tuple[str, int, str]]:
    """``(name, code, comment)`` of the exit codes :mod:`xlafit.errors` defines."""
    from xlafit import errors

    source = inspect.getsource(errors)
    return [
        (name, int(code), comment.strip())
        for name, code, comment in re.findall(r"^([A-Z_]+) = (\d+)  # (.*)$", source, re.M)
        if getattr(errors, name) == int(code)
    ]


def exit_codes_page() -> str:
    from xlafit import errors

    lines = [
        "# Exit codes and errors",
        "",
        "Generated from `xlafit.errors` at every build of these pages. Every error a user can act",
        "on is an `XlafitError`; its message says what happened and the fix, and the `xlafit`",
        "command exits with its code. Anything else that reaches you is a bug in xlafit.",
        "",
        "| code | name | meaning |",
        "|---|---|---|",
        "| 0 | | done |",
    ]
    lines += [f"| {code} | `{name}` | {_cell(comment)} |" for name, code, comment in exit_codes()]
    lines += [
        "",
        "A scheduler's restart loop reruns the same command on **75**: the run resumes from the",
        "checkpoint it wrote ([preemption and exact resume](../guides/preemption.md)).",
        "",
        "## Errors",
        "",
        "| class | exit code | when |",
        "|---|---|---|",
    ]
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.XlafitError)]
    for cls in classes:
        doc = " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())
        doc = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", doc).replace("``", "`")
        lines.append(f"| `xlafit.errors.{cls.__name__}` | {cls.exit_code} | {_cell(doc)} |")
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the MkDocs hook


def on_files(files: Any, config: Any) -> Any:
    """Adds the generated pages to the site (nothing is written under ``docs/``)."""
    from mkdocs.structure.files import File

    for uri, page in zip(PAGES, (cli_page, config_page, exit_codes_page), strict=True):
        files.append(File.generated(config, uri, content=page()))
    return files


if __name__ == "__main__":  # python docs/gen_reference.py [cli|config|exit-codes]: print a page
    which = sys.argv[1] if len(sys.argv) > 1 else "cli"
    print({"cli": cli_page, "config": config_page, "exit-codes": exit_codes_page}[which]())
