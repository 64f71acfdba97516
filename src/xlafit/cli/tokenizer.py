"""``xlafit tokenizer train``: a WordPiece vocabulary with Korean-safe defaults."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="train a WordPiece tokenizer (Korean-safe defaults)")
    tok_sub = p.add_subparsers(dest="tokenizer_command", required=True)
    t = tok_sub.add_parser(
        "train",
        help="train a BERT WordPiece vocabulary on text files",
        description="Train a BERT WordPiece tokenizer with Hugging Face tokenizers. Accents are kept (NFD would "
        "split Hangul into jamo) and case is kept unless --lowercase. Prints the unknown-token rate and "
        "tokens per word. Example: xlafit tokenizer train --input corpus/*.txt --vocab-size 32000 --out tok",
    )
    t.add_argument("--input", nargs="+", required=True, metavar="FILE", help="text files, globs, dirs or URLs")
    t.add_argument("--vocab-size", type=int, default=32000, help="tokens in the vocabulary")
    t.add_argument("--out", required=True, metavar="DIR", help="where tokenizer.json and vocab.txt go")
    t.add_argument("--min-frequency", type=int, default=2, help="merges seen fewer times are not learned")
    t.add_argument("--lowercase", action="store_true", help="lowercase Latin text (Hangul is unaffected)")
    t.add_argument("--strip-accents", action="store_true", help="NFD + drop accents: breaks Hangul, off")
    t.add_argument("--overwrite", action="store_true", help="replace a tokenizer in --out (refused without it)")
    t.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # The library when the command runs: a fast --help.
    from xlafit.data.text import expand_inputs
    from xlafit.data.tokenizer import measure, train_tokenizer

    files = expand_inputs(args.input)
    print(f"training a {args.vocab_size}-token WordPiece vocabulary on {len(files)} file(s)", flush=True)
    tok = train_tokenizer(
        files,
        args.vocab_size,
        args.out,
        min_frequency=args.min_frequency,
        lowercase=args.lowercase,
        strip_accents=args.strip_accents,
        show_progress=sys.stderr.isatty(),
        overwrite=args.overwrite,
    )
    size = tok.get_vocab_size()
    floor = " (more than --vocab-size: every character of the text gets a token, twice with ## inside words)"
    print(f"vocabulary: {size} tokens -> {args.out}" + (floor if size > args.vocab_size else ""))
    print(f"on the training text: {measure(tok, files)}")
    return 0
