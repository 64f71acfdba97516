"""The docs' "will it fit" tables, made from ``xlafit check --tpu --json``: one command per row,
its JSON stored in a dated results folder, the table rewritten in the page between markers.

    python benchmarks/tpu/fit_tables.py run llm-families --out benchmarks/results/DATE/fit-tables
    python benchmarks/tpu/fit_tables.py run llm-llama --out DIR --rows llama-3.2-1b-lora-2048
    python benchmarks/tpu/fit_tables.py render     # the pages again from the JSON their markers name
    python benchmarks/tpu/fit_tables.py commands llm-llama   # the rows' command lines, nothing run

A table in a page sits between ``<!-- fit-table NAME FOLDER -->`` and ``<!-- fit-table end -->``;
FOLDER is where its JSON is (``FOLDER/NAME/ROW.json``, or ``FOLDER/ROW.json`` for folders
written before this script). ``run`` compiles with libtpu on this machine (no TPU needed; a
row is minutes on two cores, a ``--max-batch`` row many compiles), writes
``ROW.json``/``.log``/``.cmd`` and, once every row of the table is there, points the page's
marker at the new folder and rewrites the table. tests/test_fit_tables.py checks that each
page's table is what ``render`` makes of its JSON, so a hand edit fails the suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from xlafit.check.tpu_report import rate  # the report's own figures: three digits, as the command prints

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "benchmarks/tpu/fit_tables.py"
MARKER = re.compile(r"<!-- fit-table (?P<name>[\w-]+) (?P<folder>\S+) -->\n(?P<body>.*?)<!-- fit-table end -->\n", re.S)

# bf16 compute, remat full, every core on fsdp, one sequence per core (the recipe's notebook
# settings); eval at 8 sequences.
LLM = (
    "model.compute_dtype=bfloat16 model.remat=full mesh.data=1 mesh.fsdp=-1 data.per_device_batch=1 "
    "data.global_batch=null data.eval_global_batch=8"
).split()
LORA = ["lora.rank=16", "lora.base_dtype=bfloat16"]
LORA_NF4 = ["lora.rank=16", "lora.base_dtype=nf4"]
LORA_EXPERTS = [*LORA, "lora.targets=q_proj,k_proj,v_proj,o_proj,experts"]
TRAINING = {"full": "full (AdamW, f32 state)", "lora": "LoRA r16 (bf16 base)", "lora_nf4": "LoRA r16 (NF4 base)"}
MODE_ARGS = {"full": [], "lora": LORA, "lora_nf4": LORA_NF4, "lora_experts": LORA_EXPERTS}


@dataclasses.dataclass(frozen=True)
class Row:
    """One row: its file name, its cells before the targets', and the check's arguments."""

    name: str
    label: tuple[str, ...]
    args: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Table:
    """A page's table: its header, its rows and how a target's report reads in a cell."""

    page: str
    header: tuple[str, ...]
    align: tuple[str, ...]
    rows: tuple[Row, ...]
    cell: Callable[[dict], str]
    note: str
    # The targets of the columns, as --tpu names them, where a row compiles only some of
    # them (its other cells say so); None: every row compiles every column, in order.
    targets: tuple[str, ...] | None = None
    # What follows the table in its region (a summary of its rows), from the rows' reports.
    summary: Callable[[list[tuple[Row, dict]]], list[str]] | None = None


def gib(n: float | None) -> str:
    return f"{(n or 0) / 2**30:.1f} GiB"


def max_batch_cell(t: dict) -> str:
    """HBM per core at one sequence per core, and the largest batch that compiles (--max-batch)."""
    if not t["fits"]:
        return f"no: {gib(t['memory'].get('total'))} at 1 (state {gib(t['memory'].get('state')).removesuffix(' GiB')})"
    return f"fits: {gib(t['memory'].get('total'))} at 1; {largest(t)}"


def largest(t: dict) -> str:
    """--max-batch's answer, with the first batch refused above it."""
    refused = min((p["per_device_batch"] for p in t["probes"] if not p["fits"]), default=None)
    return f"largest **{t['max_batch']:,}**" + (f" ({refused:,} does not)" if refused is not None else "")


def step_cell(t: dict) -> str:
    """HBM per core, and the step model's prediction with its median error (a prediction)."""
    if not t["fits"]:
        return f"no: {gib(t['memory'].get('total'))} (state {gib(t['memory'].get('state')).removesuffix(' GiB')})"
    band = f" ±{t['band_median']:.0%}" if t.get("band_median") is not None else ""
    speed = rate(t["tokens_per_s"], "tokens/s")
    return f"fits: {gib(t['memory'].get('total'))}; {t['step_s'] * 1e3:.0f} ms{band}, {speed}"


def largest_cell(t: dict) -> str:
    """HBM per core at the row's sequences per core; the largest batch (--max-batch) or the step
    model's prediction with its band; where it does not fit, the lever that makes it fit."""
    fixes = [lv for lv in t.get("lever_fits", []) if lv["fits"]]
    fix = f"; with `{' '.join(fixes[0]['overrides'])}` {lever_speed(fixes[0])}" if fixes else ""
    batch = t["per_device_batch"]
    if not t["fits"]:
        state = gib(t["memory"].get("state")).removesuffix(" GiB")
        return f"no: {gib(t['memory'].get('total'))} at {batch} (state {state}){fix}"
    if t.get("max_batch") is not None:
        return max_batch_cell(t) + (f"; {fixes[0]['per_device_batch']}{fix}" if fixes else "")
    memory = t["memory"]
    if memory.get("peak") and memory.get("total", 0) > t["capacity"]:  # buffers never live at once, each counted
        return (
            f"fits: {gib(memory['peak'])} at {batch} (the compiler's peak; its buffers add up to "
            f"{gib(memory['total'])}); {tokens(t)}"
        )
    return f"fits: {gib(memory.get('total'))} at {batch}; {tokens(t)}"


def tokens(t: dict) -> str:
    """The step model's tokens/s, with its median error or "not validated" (a prediction)."""
    band = f" ±{t['band_median']:.0%}" if t.get("band_median") is not None else ", not validated"
    return f"{rate(t['tokens_per_s'], 'tokens/s')} predicted{band}"


def lever_speed(lv: dict) -> str:
    """A lever's compile that fits: its memory per core and predicted tokens/s."""
    return f"fits, {gib(lv['memory'])}, {tokens(lv)}" if lv.get("tokens_per_s") else f"fits, {gib(lv['memory'])}"


def largest_summary(reports: list[tuple[Row, dict]]) -> list[str]:
    """The largest model of the rows that fits each target, per kind of training."""
    targets = {"colab": "v5e-1 (Colab)", "kaggle": "v5e-8 (Kaggle)", "v6e-8": "v6e-8"}
    best: dict[tuple[str, str], tuple[float, str]] = {}
    for row, report in reports:
        mode, params = row.label[1], float(row.label[-1].removesuffix("B"))
        for t in report["tpu"]:
            key = (mode, t["target"].partition(" = ")[0])
            if t["fits"] and params > best.get(key, (0.0, ""))[0]:
                best[key] = (params, f"{row.label[0]} at {row.label[2]} tokens")
    lines = [
        "",
        "The largest of these models that fits each TPU:",
        "",
        f"| training | {' | '.join(targets.values())} |",
        f"|---|{'|'.join('---' for _ in targets)}|",
    ]
    for mode in TRAINING.values():
        cells = [best.get((mode, t), (0.0, "none of the rows compiled"))[1] for t in targets]
        lines.append(f"| {mode} | {' | '.join(cells)} |")
    return lines


def bert_cell(t: dict) -> str:
    """HBM per core at the row's batch; with --max-batch, the largest batch that compiles."""
    batch = t["per_device_batch"]
    if not t["fits"]:
        return f"no: {gib(t['memory'].get('total'))} at {batch}"
    return f"fits: {gib(t['memory'].get('total'))} at {batch}" + (
        f"; {largest(t)}" if t.get("max_batch") is not None else ""
    )


def bert_layout_cell(t: dict) -> str:
    """:func:`bert_cell` after each core's state (parameters and AdamW moments)."""
    return f"state {gib(t['memory'].get('state'))}; {bert_cell(t)}"


# The BERT recipe as the guides show it: BERT's vocabulary on synthetic tokens, float32, AdamW.
BERT = ["data.source=synthetic", "data.global_batch=null"]
BERT_1B3 = (
    "model.preset=custom model.num_layers=24 model.hidden_size=2048 model.num_heads=16 model.intermediate_size=8192"
)
BERT_TARGETS = "v4-8,v5e-8,v6e-8"
BERT_LAYOUTS = {"dp": ("DP 8", []), "fsdp": ("FSDP 8", ["mesh.fsdp=8"])}
BERT_LAYOUTS["fsdp-remat"] = ("FSDP 8 + remat full", ["mesh.fsdp=8", "model.remat=full"])


def _bert_row(name: str, label: tuple[str, ...], tpu: str, model: str, seq: int, batch: int, *more: str) -> Row:
    args = ["bert", "--tpu", tpu, "--json", *BERT, *model.split(), f"data.seq_len={seq}"]
    return Row(name, label, (*args, f"data.per_device_batch={batch}", *more))


def _llm_row(
    model: str,
    mode: str,
    seq: int,
    scan: bool,
    max_batch: bool,
    label: tuple[str, ...],
    tpu: str = "colab,kaggle",
    batch: int = 1,
) -> Row:
    settings = [f"data.per_device_batch={batch}" if a == "data.per_device_batch=1" else a for a in LLM]
    args = [
        "llm",
        "--tpu",
        tpu,
        *(["--max-batch"] if max_batch else []),
        "--json",
        f"model.preset={model}",
        f"data.seq_len={seq}",
        *settings,
        f"model.scan_layers={str(scan).lower()}",
        *MODE_ARGS[mode],
    ]
    return Row(f"{model}-{mode}-{seq}", label, tuple(args))


def _largest_row(
    model: str, params: str, mode: str, seq: int, tpu: str, max_batch: bool = False, batch: int = 1
) -> Row:
    return _llm_row(model, mode, seq, True, max_batch, (model, TRAINING[mode], f"{seq:,}", params), tpu, batch)


TABLES = {
    # Meta's two small shapes at 2,048 and 8,192 tokens, scanned layers, largest batch per core.
    "llm-llama": Table(
        "docs/guides/llm.md",
        ("model", "training", "tokens", "v5e-1 (Colab)", "v5e-8 (Kaggle), FSDP 8"),
        ("---", "---", "---:", "---", "---"),
        tuple(
            _llm_row(m, mode, seq, True, True, (m, TRAINING[mode], f"{seq:,}"))
            for m in ("llama-3.2-1b", "llama-3.1-8b")
            for mode in ("full", "lora")
            for seq in (2048, 8192)
        ),
        max_batch_cell,
        "each row one `xlafit check llm --tpu colab,kaggle --max-batch --json ...`, in the row's `.cmd`",
    ),
    # Gemma 3 1B (unscanned: its sliding-window and global layers differ) and Qwen3 1.7B, at
    # 2,048 tokens, one sequence per core, with the step model's prediction.
    "llm-families": Table(
        "docs/guides/llm.md",
        ("model", "training", "v5e-1 (Colab)", "v5e-8 (Kaggle), FSDP 8"),
        ("---", "---", "---", "---"),
        tuple(
            _llm_row(m, mode, 2048, m != "gemma-3-1b", False, (m, TRAINING[mode]))
            for m in ("gemma-3-1b", "qwen3-1.7b")
            for mode in ("full", "lora")
        ),
        step_cell,
        "each row one `xlafit check llm --tpu colab,kaggle --json ...`, in the row's `.cmd`",
    ),
    # The largest models each TPU trains: full, LoRA on a bf16 base, LoRA on an NF4 base;
    # each row compiled only for the TPUs where its answer is in doubt.
    "llm-largest": Table(
        "docs/guides/llm.md",
        ("model", "training", "tokens", "parameters", "v5e-1 (Colab)", "v5e-8 (Kaggle), FSDP 8", "v6e-8, FSDP 8"),
        ("---", "---", "---:", "---:", "---", "---", "---"),
        (
            _largest_row("llama-3.1-8b", "8.0B", "lora_nf4", 2048, "colab", max_batch=True),
            # unscanned: its last layers reuse earlier layers' keys and values (no repeating block)
            _llm_row(
                "gemma-4-e4b",
                "lora",
                2048,
                False,
                False,
                ("gemma-4-e4b", TRAINING["lora"], "2,048", "7.5B"),
                "colab,kaggle",
            ),  # fmt: skip
            _largest_row("gemma-3-12b", "11.8B", "lora_nf4", 2048, "colab"),
            _largest_row("qwen3-14b", "14.8B", "lora_nf4", 2048, "colab"),
            _largest_row("qwen3.5-9b", "9.0B", "lora_nf4", 2048, "colab"),
            _largest_row("llama-3.1-70b", "70.6B", "lora_nf4", 2048, "kaggle,v6e-8"),
            _largest_row("gemma-3-27b", "27.0B", "lora", 4096, "kaggle,v6e-8"),
            _largest_row("qwen3-32b", "32.8B", "lora", 4096, "kaggle,v6e-8"),
            _largest_row("qwen3.5-27b", "26.9B", "lora", 4096, "kaggle"),
            _largest_row("llama-3.1-8b", "8.0B", "lora", 8192, "kaggle", batch=4),  # 4 a core: the bar asked
            _largest_row("llama-3.1-8b", "8.0B", "full", 2048, "v6e-8"),
            _largest_row("qwen3-14b", "14.8B", "full", 2048, "v6e-8"),
        ),
        largest_cell,
        "each row one `xlafit check llm --tpu TARGETS --json ...`, in the row's `.cmd`",
        targets=("colab", "kaggle", "v6e-8"),
        summary=largest_summary,
    ),
    # Mixtures of experts with LoRA on the attention and on every expert (lora.targets=...,experts),
    # their bf16 base split over a v5e-8's cores.
    "llm-moe": Table(
        "docs/guides/llm.md",
        ("model", "training", "tokens", "parameters", "v5e-8 (Kaggle), FSDP 8"),
        ("---", "---", "---:", "---:", "---"),
        tuple(
            _llm_row(
                m,
                "lora_experts",
                2048,
                True,
                False,
                (m, "LoRA r16 on attention and experts (bf16 base)", "2,048", params),
                "kaggle",
            )
            for m, params in (("qwen3-30b-a3b", "30.5B"), ("qwen3.5-35b-a3b", "34.7B"), ("gemma-4-26b-a4b", "25.2B"))
        ),
        largest_cell,
        "each row one `xlafit check llm --tpu kaggle --json ...`, in the row's `.cmd`",
        targets=("kaggle",),
    ),
    # BERT on the TPUs users rent, data parallel, at seq 128 and 512.
    "bert-targets": Table(
        "docs/guides/will-it-fit.md",
        ("model, seq", "per-core batch", "v4-8", "v5e-8 (Kaggle)", "v6e-8"),
        ("---", "---:", "---", "---", "---"),
        tuple(
            _bert_row(f"bert-{m}-{seq}", (f"{m}, {seq}", str(batch)), BERT_TARGETS, f"model.preset={m}", seq, batch)
            for m, seq, batch in (("base", 128, 32), ("base", 512, 32), ("large", 128, 32), ("large", 512, 8))
        ),
        bert_cell,
        "each row one `xlafit check bert --tpu v4-8,v5e-8,v6e-8 --json ...`, in the row's `.cmd`",
        targets=("v4-8", "v5e-8", "v6e-8"),
    ),
    # Three BERT sizes on a v5e-8 replicated, split (FSDP) and split with every layer recomputed.
    "bert-layouts": Table(
        "docs/guides/parallelism.md",
        ("model", "layout", "v5e-8 (Kaggle): state per core; HBM at a per-core batch"),
        ("---", "---", "---"),
        tuple(
            _bert_row(
                f"bert-{size}-{layout}",
                (title, BERT_LAYOUTS[layout][0]),
                "v5e-8",
                model,
                128,
                batch,
                *BERT_LAYOUTS[layout][1],
            )
            for size, title, model, batch in (
                ("base", "BERT-base (110M)", "model.preset=base", 32),
                ("large", "BERT-large (335M)", "model.preset=large", 32),
                ("1b3", "BERT 24 x 2048 (1.28B)", BERT_1B3, 8),
            )
            for layout in BERT_LAYOUTS
        ),
        bert_layout_cell,
        "each row one `xlafit check bert --tpu v5e-8 --json ...`, in the row's `.cmd`",
        targets=("v5e-8",),
    ),
}


def command(row: Row) -> str:
    """The row's command line as a user types it."""
    return " ".join(["xlafit", "check", *row.args])


def report_of(path: Path) -> dict:
    """A stored ``check --json`` output (a note printed before the JSON is skipped)."""
    text = path.read_text()
    return json.loads(text[text.index("{") :])


def stored_report(path: Path) -> dict | None:
    """:func:`report_of` ``path``, or None where the row has no JSON yet (or is being written)."""
    try:
        return report_of(path)
    except (OSError, ValueError):
        return None


def row_file(folder: Path, table: str, row: Row) -> Path:
    """``FOLDER/TABLE/ROW.json``; a folder written before this script holds ``FOLDER/ROW.json``."""
    nested = folder / table / f"{row.name}.json"
    return nested if nested.exists() or not (folder / f"{row.name}.json").exists() else folder / f"{row.name}.json"


def render(name: str, folder: Path) -> str:
    """The table ``name`` from the JSON under ``folder`` (relative to the repository root)."""
    table = TABLES[name]
    lines = [f"| {' | '.join(table.header)} |", f"|{'|'.join(table.align)}|"]
    reports = []
    for row in table.rows:
        path = row_file(ROOT / folder, name, row)
        report = stored_report(path) if table.targets is not None else report_of(path)
        if report is None:  # a row still to compile (or compiling): its command says how
            asked = row.args[row.args.index("--tpu") + 1].split(",")
            cells = ["not compiled yet" if t in asked else "not compiled" for t in table.targets or ()]
            lines.append(f"| {' | '.join([*row.label, *cells])} |")
            continue
        reports.append((row, report))
        targets = report["tpu"]
        if table.targets is not None:  # a column per target, whether the row compiled it or not
            by_name = {t["target"].partition(" = ")[0]: t for t in targets}
            cells = [table.cell(by_name[n]) if n in by_name else "not compiled" for n in table.targets]
        else:
            cells = [table.cell(t) for t in targets]
        lines.append(f"| {' | '.join([*row.label, *cells])} |")
    if table.summary is not None:
        lines.extend(table.summary(reports))
    if (ROOT / folder / name).is_dir():
        made = f"Made by `python {SCRIPT} run {name} --out {folder}` ({table.note}); its JSON is in `{folder}/{name}/`."
    else:  # a folder of an earlier script that ran the same commands
        made = (
            f"Made by `python {SCRIPT} run {name} --out benchmarks/results/DATE/fit-tables` ({table.note}); "
            f"the JSON behind this table is in `{folder}/`."
        )
    return "\n".join([*lines, "", *textwrap.wrap(made, 92, break_long_words=False, break_on_hyphens=False)]) + "\n"


def regions(page: Path) -> list[re.Match[str]]:
    return list(MARKER.finditer(page.read_text()))


def rewrite(page: Path, name: str | None = None, folder: str | None = None) -> bool:
    """Renders the tables of ``page`` (or only ``name``, pointed at ``folder``); True if it changed."""
    text = page.read_text()

    def fill(m: re.Match[str]) -> str:
        if name is not None and m["name"] != name:
            return m[0]
        where = folder if folder is not None else m["folder"]
        return f"<!-- fit-table {m['name']} {where} -->\n{render(m['name'], Path(where))}<!-- fit-table end -->\n"

    new = MARKER.sub(fill, text)
    page.write_text(new)
    return new != text


def run(name: str, out: Path, only: set[str] | None) -> list[str]:
    """Compiles the table's rows (all, or ``only``), one ``xlafit check`` each; the rows whose JSON is missing."""
    table = TABLES[name]
    folder = ROOT / out / name
    folder.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    for row in table.rows:
        if only is not None and row.name not in only:
            continue
        (folder / f"{row.name}.cmd").write_text(command(row) + "\n")
        start = time.perf_counter()
        with open(folder / f"{row.name}.json", "w") as stdout, open(folder / f"{row.name}.log", "w") as stderr:
            code = subprocess.call(
                [sys.executable, "-m", "xlafit", "check", *row.args], stdout=stdout, stderr=stderr, env=env, cwd=ROOT
            )
        # exit 1: a target does not fit, which is a row's answer; 2 and above: no report
        print(f"{row.name}: exit {code} in {time.perf_counter() - start:.0f} s", flush=True)
    return [row.name for row in table.rows if stored_report(folder / f"{row.name}.json") is None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("run", help="compile a table's rows, store their JSON, rewrite its page")
    p.add_argument("table", choices=sorted(TABLES))
    p.add_argument(
        "--out", required=True, type=Path, help="the dated results folder, e.g. benchmarks/results/DATE/fit-tables"
    )
    p.add_argument("--rows", help="only these rows (comma-separated names, as in `commands`)")
    sub.add_parser("render", help="rewrite every page's tables from the JSON their markers name")
    p = sub.add_parser("commands", help="print a table's command lines")
    p.add_argument("table", choices=sorted(TABLES))
    args = parser.parse_args()
    if args.action == "commands":
        for row in TABLES[args.table].rows:
            print(f"{row.name}: {command(row)}")
    elif args.action == "render":
        for page in sorted({t.page for t in TABLES.values()}):
            print(f"{page}: {'rewritten' if rewrite(ROOT / page) else 'unchanged'}")
    else:
        only = set(args.rows.split(",")) if args.rows else None
        missing = run(args.table, args.out, only)
        if missing:
            print(f"the page is left as it is: no JSON yet for {', '.join(missing)}")
        else:
            rewrite(ROOT / TABLES[args.table].page, args.table, args.out.as_posix())
            print(f"{TABLES[args.table].page}: {args.table} rendered from {args.out}")


if __name__ == "__main__":
    main()
