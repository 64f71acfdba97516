"""``xlafit data mlm|images``: training data prepared once, as shards + a manifest;
``xlafit data show``: what the llm recipe trains on of a few records."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from xlafit.errors import DataError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare training data")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    _register_mlm(data_sub)
    _register_images(data_sub)
    _register_show(data_sub)


def _register_mlm(data_sub: argparse._SubParsersAction) -> None:
    p = data_sub.add_parser(
        "mlm",
        help="tokenize text into fixed-length masked-LM sequences (Parquet shards + manifest)",
        description="Stream text files through a tokenizer and pack them into sequences of --seq-len tokens, "
        "written as Parquet shards plus manifest.json to a directory or fsspec URL (gs:// needs gcsfs). "
        "Input: one sentence or paragraph per line, documents separated by blank lines (or one per file).",
    )
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="from `xlafit tokenizer train`")
    p.add_argument("--input", nargs="+", required=True, metavar="FILE", help="text files, globs, dirs or URLs")
    p.add_argument("--out", required=True, metavar="URL", help="a directory or fsspec URL")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence, [CLS] and [SEP] included")
    p.add_argument(
        "--packing",
        choices=("sentences", "pairs"),
        default="sentences",
        help="sentences: [CLS] text... [SEP] across lines and documents (RoBERTa); "
        "pairs: [CLS] A [SEP] B [SEP] with token types (BERT)",
    )
    p.add_argument(
        "--doc-boundary", choices=("blank", "file"), default="blank", help="documents end at a blank line, or a file"
    )
    p.add_argument("--eval-fraction", type=float, default=0.05, help="documents held out for evaluation")
    p.add_argument("--seed", type=int, default=0, help="the held-out documents and the packing's draws")
    p.add_argument("--shard-size", type=int, default=65536, help="sequences per shard")
    p.add_argument(
        "--overwrite", action="store_true", help="replace data prepared in --out before (refused without it)"
    )
    p.set_defaults(run=run_mlm)


def _register_images(data_sub: argparse._SubParsersAction) -> None:
    p = data_sub.add_parser(
        "images",
        help="an image folder (class/*.jpg|png) -> shards of encoded images + labels + manifest",
        description="Read an ImageFolder (class/*.jpg|png, or train/ and val/ of such folders) and write the "
        "encoded images, labels and file names as Parquet shards plus manifest.json (per-shard SHA-256) to a "
        "directory or fsspec URL. Every image is decoded once here, so an unreadable one is named now.",
    )
    p.add_argument("--input", required=True, metavar="DIR", help="an image folder")
    p.add_argument("--out", required=True, metavar="URL", help="a directory or fsspec URL")
    p.add_argument(
        "--eval-fraction", type=float, default=0.0, help="held out for evaluation, when --input has no val/ folder"
    )
    p.add_argument("--seed", type=int, default=0, help="which images --eval-fraction holds out")
    p.add_argument("--shard-size", type=int, default=1024, help="images per shard")
    p.add_argument("--on-corrupt", choices=("skip", "stop"), default="skip", help="an image that cannot be decoded")
    p.add_argument("--workers", type=int, help="processes decoding to check (default: every core)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace images prepared in --out before (refused without it)"
    )
    p.set_defaults(run=run_images)


def _register_show(data_sub: argparse._SubParsersAction) -> None:
    p = data_sub.add_parser(
        "show",
        help="a few records as the llm recipe trains on them (the trained tokens marked), or prepared "
        "image or MLM data in words",
        description="Encode the first records (or documents) of FILE as `xlafit train llm` does: the chat "
        "template, the tokenizer's own <bos> and <eos>, the loss mask, the cut at --seq-len. Print each one's "
        "text as the model reads it (special tokens shown) with the text the loss trains on between "
        "\u27e6 and \u27e7 (in colour on a terminal), and its counts of tokens and trained tokens. "
        "FILE a directory `xlafit data images` or `xlafit data mlm` prepared: its splits, classes or documents, "
        "and its first training examples as stored (no --tokenizer: the data names its own).",
    )
    p.add_argument(
        "file",
        metavar="FILE",
        help="text, Parquet or JSON-lines records (chat, prompt/completion, text, preference pairs, GRPO's "
        "prompts), or a prepared image or MLM directory",
    )
    p.add_argument(
        "--tokenizer",
        metavar="T",
        help="a tokenizer.json, the folder holding one, or a model folder (records: required)",
    )
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template instead of the tokenizer's")
    p.add_argument("--loss-on", choices=("assistant", "all"), default="assistant", help="what the loss counts")
    p.add_argument(
        "--format", default="auto", choices=("auto", "text", "chat", "prompt_completion"), help="the records' format"
    )
    p.add_argument("--text-column", default="text", help="the field of text records and Parquet files")
    p.add_argument(
        "--seq-len",
        type=int,
        help="tokens per row: a record is cut here (data.seq_len; default: the llm recipe's, what a run cuts at)",
    )
    p.add_argument("-n", "--records", type=int, default=3, metavar="N", help="how many records to show")
    p.add_argument(
        "--color", choices=("auto", "always", "never"), default="auto", help="trained text in colour (auto: a terminal)"
    )
    p.set_defaults(run=run_show)


def run_show(args: argparse.Namespace) -> int:
    from xlafit.data import chat, clm, prepared, rendering, show  # the library when the command runs: a fast --help
    from xlafit.data.files import kind, splits
    from xlafit.recipes import llm_data, load_config

    if made_by := prepared.kind(args.file):
        for line in prepared.describe(args.file, max(args.records, 0), made_by):
            print(line)
        return 0
    if args.tokenizer is None:
        raise DataError(
            f"{args.file}: records are shown as a run encodes them, with its tokenizer: give --tokenizer T "
            "(a tokenizer.json, the folder holding one, or the model's folder). Data that `xlafit data images` "
            "or `xlafit data mlm` prepared is shown without one: give its directory."
        )

    overrides = [
        f"data.data_dir={args.file}",
        f"data.tokenizer={args.tokenizer}",
        f"data.loss_on={args.loss_on}",
        f"data.format={args.format}",
        f"data.text_column={args.text_column}",
    ]
    overrides += [f"data.seq_len={args.seq_len}"] if args.seq_len is not None else []  # else the recipe's, as a run
    overrides += [f"data.chat_template={args.chat_template}"] if args.chat_template else []
    cfg = load_config("llm", overrides)
    e = llm_data.encoding(cfg)
    found = splits(e.inputs)  # a folder of splits: its train files, as a run trains on them
    files = found.train
    if found.said:
        print(found.said.replace("data.eval_fraction", "a share of the training records"))
    d = llm_data.data_config(cfg)
    # Preference pairs are shown as a pair each (a text file is no record file: not read here).
    first = chat.read_records(files[:1]) if files and kind(files[0]) != "text" else []
    if first and {"chosen", "rejected"} <= set(first[0]):
        return _show_pairs(files[0], first, e, d.seq_len, args)
    if first and "prompt" in first[0] and not {"completion", "messages"} & set(first[0]):
        return _show_prompts(files[0], first, e, args)
    try:
        encoded, fmt = clm.encode_files(
            files, e.tok, d.format, d.text_column, e.template, d.loss_on, e.markers, limit=max(args.records, 0)
        )
    except DataError as error:  # in this command's words: its flags, not the config's keys
        raise DataError(_in_flags(str(error))) from None
    if not encoded:  # as training refuses it: an empty file shows nothing, and says so
        raise DataError(
            f"{args.file} holds no documents or records to show; give text files (documents separated by blank "
            "lines), Parquet files with a text column, or JSON-lines records."
        )
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    name = lambda i: e.tok.id_to_token(i) if i is not None else "none"  # noqa: E731
    print(
        f"{args.file}: "
        + ("text documents" if fmt == "text" else f"{fmt} records")
        + f"; tokenizer {args.tokenizer}: {name(e.markers[0])} before and "
        f"{name(e.markers[1])} after each document and prompt/completion record; cut at --seq-len {d.seq_len}; "
        "loss on "
        + ("every token" if d.loss_on == "all" or fmt == "text" else "the answers")
        + ("" if color else f"; trained text between {show.OPEN} and {show.CLOSE}")
    )
    if fmt == "chat":  # a family's training template may stand in for the tokenizer's, as in a run
        print(f"  {rendering.describe(e.template).replace('(data.chat_template)', '(--chat-template)')}")
    for number, record in enumerate(encoded, 1):
        s = show.shown(e.tok, record, fmt, d.seq_len)
        cut = f", cut at --seq-len {d.seq_len} (at {show.CUT})" if s.cut is not None else ""
        if not any(s.trained):  # as load_packed leaves it out (Source.without_loss)
            cut += (
                ": no answer token is left, and training leaves the record out"
                if cut
                else "; no token of it counts for the loss (no answer), and training leaves the record out"
            )
        print(f"\n--- record {number}: {len(s.ids)} tokens, {sum(s.trained)} trained{cut}")
        print(show.render(s.runs, color, s.cut))
    return 0


def _in_flags(message: str) -> str:
    """A message naming the llm config's data keys, in ``data show``'s flags."""
    for key in ("text_column", "format", "seq_len", "loss_on", "chat_template"):
        message = message.replace(f"data.{key}", f"--{key.replace('_', '-')}")
    return message


def _show_pairs(file: str, records: list[dict[str, Any]], e: Any, seq_len: int, args: argparse.Namespace) -> int:
    """The first preference pairs of ``file`` (its ``records``) as a preference objective trains
    on them: each completion after its prompt, the completion's tokens (what DPO, SimPO and ORPO
    compare) marked."""
    from xlafit.data import preference, show
    from xlafit.data.chat import check_one_kind

    records = records[: max(args.records, 0)]
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    print(
        f"{file}: preference pairs (train them with model.objective=dpo, simpo or orpo); tokenizer {args.tokenizer}; "
        "each completion after its prompt"
        + ("" if color else f"; the compared completion between {show.OPEN} and {show.CLOSE}")
    )
    first: dict[str, str] = {}
    for number, record in enumerate(records, 1):
        where = f"{file}, record {number}"
        kind = preference.check_pair(record, where)
        check_one_kind(first, kind, where, "preference records")
        try:
            pair = preference.encode_pair(record, kind, e.tok, e.template, bos=e.markers[0], eos=e.markers[1])
        except DataError as error:
            raise DataError(f"{where}: {error}") from None
        if preference.other_turns(record, kind):
            print(f"\n(record {number} holds another role's turns inside chosen or rejected: only the assistant's "
                  "are compared)")  # fmt: skip
        for side, encoded in zip(("chosen", "rejected"), pair, strict=True):
            s = show.shown(e.tok, encoded, "prompt_completion", seq_len)
            cut = f", cut at --seq-len {seq_len} (at {show.CUT})" if s.cut is not None else ""
            print(f"\n--- record {number}, {side}: {len(s.ids)} tokens, {sum(s.trained)} compared{cut}")
            print(show.render(s.runs, color, s.cut))
    return 0


def _show_prompts(file: str, records: list[dict[str, Any]], e: Any, args: argparse.Namespace) -> int:
    """The first prompt records of ``file`` as GRPO's rollout gives them to the model (a
    conversation in the chat template with its generation prompt, a text after ``<bos>``),
    with their token counts and the columns the reward functions get."""
    from xlafit.data import prompts, show
    from xlafit.data.chat import check_one_kind

    print(
        f"{file}: prompts (train them with model.objective=grpo and reward functions); tokenizer {args.tokenizer}; "
        "each prompt as the rollout gives it to the model, its completions following it (up to "
        "model.grpo.max_completion_length tokens each)"
    )
    first: dict[str, str] = {}
    for number, record in enumerate(records[: max(args.records, 0)], 1):
        kind = prompts.check_prompt(record, f"{file}, record {number}")
        check_one_kind(first, kind, f"{file}, record {number}", "prompt records")
        ids = prompts.encode_prompt(record["prompt"], kind, e.tok, e.template, bos=e.markers[0])
        columns = ", ".join(k for k in record if k != "prompt") or "none"
        print(f"\n--- record {number}: {len(ids)} prompt tokens ({kind}); columns for the rewards: {columns}")
        print(show.render(show.runs(e.tok, ids, [False] * len(ids)), color=False))
    return 0


def run_mlm(args: argparse.Namespace) -> int:
    # The library when the command runs: a fast --help.
    from xlafit.data.mlm import prepare
    from xlafit.data.text import expand_inputs

    manifest = prepare(
        args.tokenizer,
        expand_inputs(args.input),
        args.out,
        seq_len=args.seq_len,
        packing=args.packing,
        doc_boundary=args.doc_boundary,
        eval_fraction=args.eval_fraction,
        seed=args.seed,
        shard_size=args.shard_size,
        show_progress=sys.stderr.isatty(),
        overwrite=args.overwrite,
    )
    for split, info in manifest["splits"].items():
        fill = info["tokens"] / max(info["sequences"] * args.seq_len, 1)
        print(
            f"{split}: {info['documents']:,} document{'' if info['documents'] == 1 else 's'} -> "
            f"{info['sequences']:,} sequences of {args.seq_len} "
            f"({info['tokens']:,} tokens, {fill:.1%} not padding) in {len(info['shards'])} shard(s)"
        )
    held_out = manifest["splits"].get("eval", {"sequences": 0})
    if args.eval_fraction > 0 and held_out["sequences"] == 0:
        print(
            f"note: --eval-fraction {args.eval_fraction} held out no document (--doc-boundary {args.doc_boundary}): "
            "a run on this data trains without evaluation. Give more documents, or a larger --eval-fraction.",
            file=sys.stderr,
        )
    print(f"written to {args.out} (manifest.json)")
    return 0


def run_images(args: argparse.Namespace) -> int:
    from xlafit.data.images import prepare  # the library when the command runs: a fast --help

    manifest = prepare(
        args.input,
        args.out,
        eval_fraction=args.eval_fraction,
        seed=args.seed,
        shard_size=args.shard_size,
        on_corrupt=args.on_corrupt,
        workers=args.workers,
        overwrite=args.overwrite,
    )
    for split, info in manifest["splits"].items():
        classes = f"{info['classes']} of the {len(manifest['classes'])}"
        print(f"{split}: {info['examples']:,} images of {classes} classes in {len(info['shards'])} shard(s)")
        if info["skipped"]:
            names = ", ".join(s["file"] for s in info["skipped"][:5])
            more = f" and {len(info['skipped']) - 5} more" if len(info["skipped"]) > 5 else ""
            print(f"  skipped {len(info['skipped'])} that cannot be decoded: {names}{more} (listed in the manifest)")
    print(f"written to {args.out} (manifest.json)")
    return 0
