"""WordPiece tokenizers for BERT with Hugging Face ``tokenizers``, safe for Korean.

BERT's default normaliser lowercases and strips accents, and stripping accents means NFD
decomposition: every Hangul syllable falls apart into jamo (``"한" -> "ㅎ ㅏ ㄴ"``), which
triples the sequence length and loses the syllable vocabulary. Here accents are kept and
case is kept unless asked (lowercasing leaves Hangul alone; it is NFD that hurts).

The output directory loads with ``tokenizers.Tokenizer.from_file(DIR/tokenizer.json)``
and with ``transformers.AutoTokenizer.from_pretrained(DIR)``.

Example:
    >>> tok = train_tokenizer(["corpus.txt"], vocab_size=8000, out="tok/")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tqdm import tqdm

from xlafit.data.text import read_lines
from xlafit.errors import DataError, StorageError
from xlafit.io.paths import as_path, check_bucket, describe_error, is_url, upload_dir

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4, in this order
PAD, UNK, CLS, SEP, MASK = range(len(SPECIAL_TOKENS))  # their ids in every vocabulary trained here
# Bumped whenever the same text and settings would train a different vocabulary (caches
# of trained tokenizers key on it). 2: reproducible "##x" numbering.
TRAINER_VERSION = 2


@dataclasses.dataclass(frozen=True)
class TokenizerStats:
    """How well a tokenizer fits a text: unknown-token rate and tokens per word."""

    words: int
    tokens: int
    unknown: int

    @property
    def unknown_rate(self) -> float:
        return self.unknown / max(self.tokens, 1)

    @property
    def tokens_per_word(self) -> float:
        return self.tokens / max(self.words, 1)

    def __str__(self) -> str:
        return (
            f"{self.tokens:,} tokens for {self.words:,} words: {self.tokens_per_word:.2f} tokens/word, "
            f"unknown-token rate {self.unknown_rate:.3%}"
        )


def new_tokenizer(lowercase: bool = False, strip_accents: bool = False) -> Tokenizer:
    """An untrained BERT WordPiece tokenizer (normaliser, pre-tokenizer, decoder)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def _lines(files: Sequence[str]) -> Iterator[str]:
    for _, line in read_lines(files):
        if line:
            yield line


def _continuation_tokens(files: Sequence[str], lowercase: bool, strip_accents: bool, show_progress: bool) -> list[str]:
    """Every ``"##x"`` token the trainer will make from ``files``, sorted: a first pass of the
    trainer itself (parallel, in Rust) with no room for merges, so it stops after counting."""
    probe = new_tokenizer(lowercase, strip_accents)
    if show_progress:
        print("pass 1 of 2: the characters inside words", file=sys.stderr, flush=True)
    probe.train_from_iterator(
        _lines(files),
        trainers.WordPieceTrainer(vocab_size=1, continuing_subword_prefix="##", show_progress=show_progress),
    )
    return sorted(t for t in probe.get_vocab() if t.startswith("##") and len(t) == 3)


def train_tokenizer(
    files: Sequence[str],
    vocab_size: int,
    out: str | Path,
    *,
    min_frequency: int = 2,
    lowercase: bool = False,
    strip_accents: bool = False,
    show_progress: bool = True,
    overwrite: bool = False,
) -> Tokenizer:
    """Trains a WordPiece vocabulary on ``files`` (streamed) and saves it to ``out``.

    The same files and settings give the same vocabulary, byte for byte, on every run.

    Args:
        files: UTF-8 text files or URLs.
        vocab_size: the vocabulary's size, the 5 special tokens included.
        out: directory (or URL) for ``tokenizer.json``, ``vocab.txt`` and the transformers configs.
        min_frequency: a merge must occur this often.
        lowercase: lowercase Latin text (Hangul has no case and is unaffected).
        strip_accents: NFD + drop combining marks; splits Hangul into jamo, so off.
        overwrite: replace a tokenizer ``out`` holds already (refused without it).

    Raises:
        DataError: ``out`` is a file or holds a tokenizer (without ``overwrite``),
            ``vocab_size`` too small, or no text in ``files``.
    """
    if is_url(out):  # an unreachable store or a missing bucket: refused before the training, not after it
        try:
            check_bucket(str(out), "--out")
        except StorageError as e:
            raise DataError(str(e)) from None
    target = as_path(out)
    if target.is_file():
        raise DataError(f"--out {out} is a file; give a directory (tokenizer.json, vocab.txt and configs go in it).")
    if not overwrite and (target / "tokenizer.json").exists():
        raise DataError(
            f"--out {out} holds a tokenizer already, kept: data prepared with it and runs trained on it need its "
            "token ids. Give another --out, or --overwrite to replace it."
        )
    if vocab_size <= len(SPECIAL_TOKENS) + 10:
        raise DataError(f"--vocab-size {vocab_size} is too small; BERT vocabularies hold thousands (try 8000).")
    tok = new_tokenizer(lowercase, strip_accents)
    # The trainer numbers the "##x" tokens in hash-map order, which changes from process to
    # process, and breaks ties between equally frequent merges by those numbers: the same
    # text gave a different vocabulary on every run (huggingface/tokenizers#1794). Handing
    # it every "##x" up front, sorted, as special tokens fixes their numbers; they are
    # demoted to ordinary vocabulary entries afterwards. Costs a second counting pass.
    continuations = _continuation_tokens(files, lowercase, strip_accents, show_progress)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[*SPECIAL_TOKENS, *continuations],
        continuing_subword_prefix="##",
        show_progress=show_progress,
    )
    if show_progress:
        print("pass 2 of 2: the vocabulary", file=sys.stderr, flush=True)
    tok.train_from_iterator(_lines(files), trainer)
    if tok.get_vocab_size() <= len(SPECIAL_TOKENS) + len(continuations):
        raise DataError(f"no text found in {', '.join(files)}.")
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in SPECIAL_TOKENS]
    tok = Tokenizer.from_str(json.dumps(spec))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    save_tokenizer(tok, out, lowercase=lowercase, strip_accents=strip_accents)
    return tok


def save_tokenizer(tok: Tokenizer, out: str | Path, *, lowercase: bool, strip_accents: bool) -> Path:
    """``tokenizer.json`` + ``vocab.txt`` + the configs ``AutoTokenizer`` reads, in ``out``:
    a directory, or a URL (written locally, then uploaded; the local directory is returned)."""
    if is_url(out):
        with tempfile.TemporaryDirectory() as tmp:
            save_tokenizer(tok, tmp, lowercase=lowercase, strip_accents=strip_accents)
            try:
                upload_dir(Path(tmp), as_path(out))
            except Exception as e:
                raise DataError(f"cannot write the tokenizer: {describe_error(out, e)}") from None
        return Path(out)
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    (d / "vocab.txt").write_text("".join(f"{token}\n" for token, _ in vocab), encoding="utf-8")
    names = dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), SPECIAL_TOKENS, strict=True))
    config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": lowercase,
        "strip_accents": strip_accents,
        "tokenize_chinese_chars": True,
        "model_max_length": 512,
        **names,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (d / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")
    return d


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer saved in ``directory`` by :func:`train_tokenizer`.

    Raises:
        DataError: no ``tokenizer.json`` there, not one, or it lacks BERT's special tokens.
    """
    path = as_path(directory) / "tokenizer.json"  # a local directory or a URL
    try:
        found = path.exists()
    except Exception as e:
        raise DataError(f"cannot read the tokenizer: {describe_error(path, e)}") from None
    if not found:
        raise DataError(f"{directory} holds no tokenizer.json; create one with `xlafit tokenizer train`.")
    tok = read_tokenizer_json(path, "make one with `xlafit tokenizer train`.")
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise DataError(f"the tokenizer in {directory} lacks BERT's special tokens {missing}.")
    return tok


def read_tokenizer_json(where: str | Path, fix: str) -> Tokenizer:
    """The tokenizer in the ``tokenizer.json`` file ``where`` (local or a URL).

    Raises:
        DataError: the file cannot be read, or is not a Hugging Face ``tokenizer.json``;
            ``fix`` ends the message with what to give instead.
    """
    path = as_path(where)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read the tokenizer: {describe_error(path, e)}") from None
    except UnicodeDecodeError:
        raise DataError(f"{path} is not a Hugging Face tokenizer.json (it is not UTF-8 text); {fix}") from None
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for JSON that is not a tokenizer
        raise DataError(f"{path} is not a Hugging Face tokenizer.json ({e}); {fix}") from None


def measure(
    tok: Tokenizer, files: Sequence[str], max_lines: int = 100_000, show_progress: bool = False
) -> TokenizerStats:
    """Unknown-token rate and tokens per word over the first ``max_lines`` lines of ``files``."""
    words = tokens = unknown = 0
    unk_id = tok.token_to_id("[UNK]")
    batch: list[str] = []

    def count(lines: list[str]) -> None:
        nonlocal words, tokens, unknown
        words += sum(len(line.split()) for line in lines)  # words as spaces delimit them (Korean eojeol)
        for enc in tok.encode_batch(lines, add_special_tokens=False):
            tokens += len(enc.ids)
            if unk_id is not None:  # a vocabulary without [UNK] has no unknown tokens to count
                unknown += enc.ids.count(unk_id)

    lines = _lines(files)
    for i, line in enumerate(tqdm(lines, disable=not show_progress, unit="line", desc="measuring")):
        if i >= max_lines:
            break
        batch.append(line)
        if len(batch) == 1000:
            count(batch)
            batch = []
    if batch:
        count(batch)
    return TokenizerStats(words, tokens, unknown)
