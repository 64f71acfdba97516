"""The docs' fit tables are what benchmarks/tpu/fit_tables.py makes of the stored
``xlafit check --tpu --json`` outputs their markers name (nothing is compiled here)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "tpu"))
try:
    import fit_tables
finally:
    sys.path.remove(str(ROOT / "benchmarks" / "tpu"))


@pytest.mark.parametrize("name", sorted(fit_tables.TABLES))
def test_each_table_is_in_its_page_once_and_is_what_its_json_renders(name):
    page = ROOT / fit_tables.TABLES[name].page
    found = [m for m in fit_tables.regions(page) if m["name"] == name]
    assert len(found) == 1, f"{page}: {len(found)} regions named {name}"
    m = found[0]
    assert m["body"] == fit_tables.render(name, Path(m["folder"])), (
        f"{page}'s {name} table differs from its JSON: run `python benchmarks/tpu/fit_tables.py render`"
    )


def test_a_hand_edit_of_a_table_is_seen(tmp_path):
    page = ROOT / fit_tables.TABLES["llm-families"].page
    edited = tmp_path / "page.md"
    edited.write_text(
        page.read_text().replace(
            "| qwen3-1.7b | LoRA r16 (bf16 base) | fits: ", "| qwen3-1.7b | LoRA r16 (bf16 base) | fits: 1"
        )
    )
    assert edited.read_text() != page.read_text()
    assert fit_tables.rewrite(edited) and edited.read_text() == page.read_text()
    assert not fit_tables.rewrite(edited)


@pytest.mark.parametrize("name", sorted(fit_tables.TABLES))
def test_the_stored_command_lines_are_the_scripts(name):
    """A folder written by the script keeps each row's command: it must be the one the script runs now."""
    m = next(m for m in fit_tables.regions(ROOT / fit_tables.TABLES[name].page) if m["name"] == name)
    folder = ROOT / m["folder"] / name
    if not folder.is_dir():
        pytest.skip(f"{m['folder']} was written before the script, without its command lines")
    for row in fit_tables.TABLES[name].rows:
        if not (folder / f"{row.name}.json").exists():  # a row still to compile: the page says so
            continue
        assert (folder / f"{row.name}.cmd").read_text() == fit_tables.command(row) + "\n", row.name


def test_a_row_still_to_compile_says_so_for_the_targets_it_compiles(tmp_path):
    text = fit_tables.render("llm-largest", tmp_path)  # no JSON at all
    row = next(line for line in text.splitlines() if line.startswith("| llama-3.1-70b |"))
    assert row.endswith("| not compiled | not compiled yet | not compiled yet |")  # --tpu kaggle,v6e-8
    assert "| LoRA r16 (NF4 base) | none of the rows compiled | none of the rows compiled |" in text
