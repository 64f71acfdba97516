"""The Korean demo data set: a tokenizer and MLM shards built from konlpy's embedded texts.

Built once into the user cache (``$XLAFIT_CACHE/bert-demo-<hash>``), so the bert recipe
trains with no ``data.data_dir`` and no download.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from xlafit.data import mlm
from xlafit.data.text import korean_demo_files
from xlafit.data.tokenizer import TRAINER_VERSION, train_tokenizer
from xlafit.io.cache import cache_dir


def build(*, vocab_size: int, seq_len: int, packing: mlm.Packing, eval_fraction: float, seed: int) -> str:
    """Builds (once) the Korean demo's tokenizer and MLM shards; returns their directory.

    The directory's name is a hash of the settings that shape it; it is written to a
    temporary directory and renamed into place, so concurrent processes cannot see half.

    Example:
        >>> where = build(  # doctest: +SKIP
        ...     vocab_size=2000, seq_len=128, packing="sentences", eval_fraction=0.1, seed=0
        ... )
        >>> train = mlm.MLMDataset.from_prepared(where, "train")  # doctest: +SKIP
    """
    files = korean_demo_files()
    key = json.dumps([files, vocab_size, seq_len, packing, eval_fraction, seed, mlm.FORMAT, TRAINER_VERSION])
    target = cache_dir() / f"bert-demo-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / mlm.MANIFEST).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"building the Korean demo corpus in {target} (once)", flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tok_dir = Path(tmp) / "tok"
        tok = train_tokenizer(files, vocab_size, tok_dir, show_progress=False)
        out = Path(tmp) / "data"
        manifest = mlm.prepare(
            str(tok_dir),
            files,
            str(out),
            seq_len=seq_len,
            packing=packing,
            doc_boundary="blank",
            eval_fraction=eval_fraction,
            seed=seed,
            show_progress=False,
        )
        s = manifest["splits"]
        print(
            f"  tokenizer: {tok.get_vocab_size()} WordPiece tokens; sequences: {s['train']['sequences']} train, "
            f"{s['eval']['sequences']} eval, {s['train']['tokens'] + s['eval']['tokens']:,} tokens",
            flush=True,
        )
        try:
            out.rename(target)
        except OSError:  # another process finished first
            if not (target / mlm.MANIFEST).exists():
                raise
    return str(target)
