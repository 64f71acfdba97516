"""Recipe: BERT masked-LM pretraining, data-parallel on every device.

Config + model + data wiring: the tokenizer and shards come from ``xlafit tokenizer train``
and ``xlafit data mlm`` (or, with no ``data.data_dir``, from the Korean demo corpus of
:mod:`xlafit.data.korean_demo`, built once into the user cache), masks are drawn per batch
by :class:`~xlafit.data.mlm.MLMDataset`, the loop is :class:`xlafit.Trainer`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import typing
from pathlib import Path
from typing import Literal

import jax
import numpy as np
import optax
from flax import nnx

from xlafit import config as xconfig
from xlafit.config import Config
from xlafit.data import korean_demo, mlm, shards
from xlafit.data.text import read_lines
from xlafit.data.tokenizer import CLS, SEP, SPECIAL_TOKENS, load_tokenizer
from xlafit.errors import ConfigError
from xlafit.hf import bert as bert_hf
from xlafit.models.bert import PRESETS, BertConfig, BertForMaskedLM
from xlafit.recipes.base import Recipe, Throughput
from xlafit.train.losses import masked_accuracy, masked_mean

DEMO_VOCAB_SIZE, DEMO_SEQ_LEN = 2000, 128  # the Korean demo's tokenizer and sequences
DEMO_EVAL_FRACTION = 0.1  # of the demo's documents; prepared data was split by `xlafit data mlm`
SYNTHETIC_VOCAB_SIZE = 30522  # BERT's English WordPiece vocabulary (bert-base-uncased)


@dataclasses.dataclass
class BertModelConfig:
    # BERT's sizes by name; custom: the four sizes below
    preset: Literal["tiny", "mini", "small", "medium", "base", "large", "custom"] = "tiny"
    num_layers: int | None = None  # null: the preset's
    hidden_size: int | None = None  # null: the preset's
    num_heads: int | None = None  # null: the preset's
    intermediate_size: int | None = None  # the MLP's width; null: the preset's
    max_position_embeddings: int = 512  # the longest sequence the position table holds
    hidden_dropout: float = 0.1  # dropout after the embeddings, attention output and MLP
    attention_dropout: float = 0.0  # dropout on the attention probabilities
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16: mixed precision (parameters stay float32)
    # the attention kernel: cudnn (flash, GPUs) where it applies, else xla
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    dropout_bits: Literal[16, 32] = 16  # random bits per dropout decision; 32 = nnx.Dropout's draw
    init_from_hf: str | None = None  # a Hugging Face BERT directory to continue pretraining
    # Recompute activations in the backward pass, per encoder layer: none, full, or a
    # jax.checkpoint_policies name (dots_saveable, ...; models/bert.py: REMAT_POLICIES).
    remat: str = "none"
    scan_layers: bool = False  # nnx.scan over the encoder layers: one layer compiled instead of num_layers


@dataclasses.dataclass
class BertDataConfig(xconfig.DataConfig):
    """``data_dir``: a directory or URL written by ``xlafit data mlm`` (null: the demo)."""

    # null: what the data holds (a prepared data_dir: its manifest; the demo: 128 tokens and a
    # 2000-token tokenizer). Set with a data_dir, they must agree with it; the run records
    # the values used.
    seq_len: int | None = None
    vocab_size: int | None = None  # with no data_dir: the size of the demo tokenizer to train
    # how sequences are packed, as `xlafit data mlm --packing` (null: what the data holds; the
    # demo and synthetic data: sentences); set with a data_dir, it must agree with it
    packing: Literal["sentences", "pairs"] | None = None
    mask_prob: float = 0.15  # the share of tokens masked for prediction (BERT: 15%)
    max_predictions: int = 20  # masked positions per sequence at most (the MLM head runs on these)
    whole_word_mask: bool = False  # mask every piece of a word together
    eval_fraction: float = DEMO_EVAL_FRACTION  # of the demo's documents (a data_dir holds its own split)
    # synthetic: random token ids (data.seq_len, default 128; data.vocab_size, default 30522)
    # instead of a corpus: for `xlafit check --tpu` and speed tests at BERT's real sizes.
    source: Literal["corpus", "synthetic"] = "corpus"
    synthetic_examples: int = 1024  # sequences of random tokens for data.source=synthetic

    def __post_init__(self) -> None:
        super().__post_init__()
        xconfig.check_fraction(self.eval_fraction, "data.eval_fraction")
        if not 0.0 < self.mask_prob <= 1.0:  # 0 masks nothing: no loss, and an accuracy of nothing
            raise ConfigError(
                f"data.mask_prob={self.mask_prob:g} is the share of tokens masked for prediction: give a number "
                "above 0 and at most 1 (BERT: 0.15)."
            )
        xconfig.check_positive(self.max_predictions, "data.max_predictions")


def data_config(cfg: Config) -> BertDataConfig:
    """``cfg.data`` as this recipe's :class:`BertDataConfig` (its own keys typed)."""
    if not isinstance(cfg.data, BertDataConfig):
        raise TypeError(f"a bert config has a BertDataConfig, got {type(cfg.data).__name__}")
    return cfg.data


def bert_config(cfg: Config, vocab_size: int) -> BertConfig:
    """The model's :class:`BertConfig`: the preset's sizes, then the config's overrides."""
    m = cfg.model
    sizes = {
        k: getattr(m, k)
        for k in ("num_layers", "hidden_size", "num_heads", "intermediate_size")
        if getattr(m, k) is not None
    }
    if m.preset == "custom":
        missing = [k for k in PRESETS["tiny"] if k not in sizes]
        if missing:
            raise ConfigError(f"model.preset=custom needs {', '.join('model.' + k for k in missing)}.")
        base = {}
    else:
        base = PRESETS[m.preset]
    try:
        return BertConfig(
            **{**base, **sizes},
            vocab_size=vocab_size,
            max_position_embeddings=m.max_position_embeddings,
            hidden_dropout=m.hidden_dropout,
            attention_dropout=m.attention_dropout,
            dtype=m.compute_dtype,
            attention=m.attention,
            dropout_bits=m.dropout_bits,
            remat=m.remat,
            scan_layers=m.scan_layers,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


# --------------------------------------------------------------------------- data


def data_location(cfg: Config) -> str:
    """``data.data_dir``, or the Korean demo corpus (built on first use) when it is null."""
    d = data_config(cfg)
    if d.data_dir:
        return d.data_dir
    return korean_demo.build(
        vocab_size=d.vocab_size or DEMO_VOCAB_SIZE,
        seq_len=d.seq_len or DEMO_SEQ_LEN,
        packing=d.packing or "sentences",
        eval_fraction=d.eval_fraction,
        seed=d.seed,
    )


def synthetic(seq_len: int, vocab_size: int, examples: int, seed: int, masking: mlm.MaskingConfig) -> mlm.MLMDataset:
    """Random sequences ``[CLS] ids... [SEP]`` of ``seq_len`` tokens: BERT's shapes without a
    corpus. What the model learns from them means nothing; their speed and memory are real."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(len(SPECIAL_TOKENS), vocab_size, size=(examples, seq_len), dtype=np.int32)
    ids[:, 0], ids[:, -1] = CLS, SEP
    arrays: dict[str, np.ndarray] = {
        "input_ids": ids,
        "token_type_ids": np.zeros((examples, seq_len), np.int8),
        "length": np.full(examples, seq_len, np.int32),
    }
    return mlm.MLMDataset(arrays, vocab_size, dataclasses.replace(masking, whole_word=False))


def load_data(cfg: Config) -> tuple[mlm.MLMDataset, mlm.MLMDataset]:
    """(train, eval) masked-LM datasets; eval masks stay fixed (epoch 0).

    Raises:
        ConfigError: ``data.eval_fraction`` was set with a ``data_dir`` (its split was made when
            it was prepared), or ``data.source=synthetic`` with one.
    """
    d = data_config(cfg)
    masking = mlm.MaskingConfig(d.mask_prob, d.max_predictions, d.whole_word_mask, d.seed)
    if d.source == "synthetic":
        if d.data_dir:
            raise ConfigError("data.source=synthetic makes its own data: leave data.data_dir unset.")
        seq, vocab, n = d.seq_len or DEMO_SEQ_LEN, d.vocab_size or SYNTHETIC_VOCAB_SIZE, d.synthetic_examples
        return synthetic(seq, vocab, n, d.seed, masking), synthetic(seq, vocab, max(1, n // 8), d.seed + 1, masking)
    if d.data_dir and d.eval_fraction != DEMO_EVAL_FRACTION:  # refused before the data is read
        raise ConfigError(
            f"data.eval_fraction={d.eval_fraction} but {d.data_dir} was split into train and eval when it was "
            "prepared; leave data.eval_fraction unset with a data_dir (it splits the demo's documents only), or "
            f"prepare the data again with `xlafit data mlm --eval-fraction {d.eval_fraction}`."
        )
    where = data_location(cfg)
    train = mlm.MLMDataset.from_prepared(where, "train", masking)
    evaluation = mlm.MLMDataset.from_prepared(where, "eval", masking)
    packed = f", {train.packing} packing" if train.packing else ""
    print(  # what the run reads, as the llm recipe's data line says it
        f"data: {where}: {len(train)} sequences of {train.seq_len} tokens{packed} (as prepared), vocabulary "
        f"{train.vocab_size}; eval: {len(evaluation)} sequences",
        file=sys.stderr,
        flush=True,
    )
    return train, evaluation


def from_data(cfg: Config, train: mlm.MLMDataset) -> Config:
    """``cfg`` with the sequence length and vocabulary size of the data, as the run uses them.

    Raises:
        ConfigError: ``data.seq_len`` (or, with a data_dir, ``data.vocab_size`` or
            ``data.packing``) was set and contradicts the prepared data, or the sequences are longer than
            ``model.max_position_embeddings``.
    """
    d = data_config(cfg)
    if d.seq_len is not None and d.seq_len != train.seq_len:
        raise ConfigError(
            f"data.seq_len={d.seq_len} but {train.location} holds sequences of {train.seq_len} tokens; "
            f"leave data.seq_len unset (the data decides) or prepare the data again with --seq-len {d.seq_len}."
        )
    if d.data_dir and d.packing is not None and train.packing and d.packing != train.packing:
        raise ConfigError(
            f"data.packing={d.packing} but {train.location} was prepared with --packing {train.packing}; leave "
            f"data.packing unset (the data decides) or prepare the data again with --packing {d.packing}."
        )
    if d.data_dir and d.vocab_size is not None and d.vocab_size != train.vocab_size:
        raise ConfigError(
            f"data.vocab_size={d.vocab_size} but the tokenizer of {train.location} has {train.vocab_size} tokens; "
            "leave data.vocab_size unset with a data_dir (it sizes the demo's tokenizer only)."
        )
    longest = cfg.model.max_position_embeddings
    if train.seq_len > longest and not cfg.model.init_from_hf:  # a checkpoint brings its own position table
        where = f"{train.location} holds sequences" if train.location else "the sequences are"
        raise ConfigError(
            f"{where} of {train.seq_len} tokens, longer than model.max_position_embeddings={longest}; set "
            f"model.max_position_embeddings={train.seq_len} (or more), or prepare the data with --seq-len {longest} "
            "or less."
        )
    packing = typing.cast(mlm.Packing, train.packing or d.packing or "sentences")
    used = dataclasses.replace(d, seq_len=train.seq_len, vocab_size=train.vocab_size, packing=packing)
    return dataclasses.replace(cfg, data=used)


def save_artifacts(cfg: Config, run_dir: Path, train: mlm.MLMDataset) -> None:
    """Copies the tokenizer into ``run_dir/tokenizer``, for ``xlafit export hf``, and records the
    prepared data's shards (:data:`~xlafit.data.shards.FINGERPRINT_FILE`)."""
    if data_config(cfg).source == "synthetic":
        return  # no tokenizer: random ids
    if train.location is None:
        raise ConfigError("the bert recipe's training data must come from a prepared directory (its tokenizer).")
    fs, root, manifest = mlm.read_manifest(train.location)
    (run_dir / shards.FINGERPRINT_FILE).write_text(json.dumps(shards.fingerprint(manifest)) + "\n")
    dest = run_dir / "tokenizer"
    dest.mkdir(parents=True, exist_ok=True)
    for name in fs.ls(f"{root}/tokenizer", detail=False):
        with fs.open(name, "rb") as f:
            (dest / Path(name).name).write_bytes(f.read())


# --------------------------------------------------------------------------- model


def build_model(cfg: Config, train: mlm.MLMDataset) -> BertForMaskedLM:
    bert = bert_config(cfg, train.vocab_size)
    if cfg.model.init_from_hf:
        model = bert_hf.from_hf(
            cfg.model.init_from_hf,
            rngs=nnx.Rngs(params=cfg.trainer.seed, dropout=cfg.trainer.seed + 1),
            hidden_dropout=bert.hidden_dropout,
            attention_dropout=bert.attention_dropout,
            dtype=bert.dtype,
            attention=bert.attention,
            dropout_bits=bert.dropout_bits,
            remat=bert.remat,
        )
        if model.cfg.vocab_size != train.vocab_size:
            raise ConfigError(
                f"{cfg.model.init_from_hf} has a vocabulary of {model.cfg.vocab_size} tokens, the data's tokenizer "
                f"{train.vocab_size}; prepare the data with that checkpoint's tokenizer."
            )
        return model
    return BertForMaskedLM(bert, rngs=nnx.Rngs(params=cfg.trainer.seed, dropout=cfg.trainer.seed + 1))


def loss_fn(model: BertForMaskedLM, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-sequence mean cross-entropy over its masked positions, and masked-token accuracy."""
    logits = model(
        batch["input_ids"],
        batch["attention_mask"],
        batch["token_type_ids"],
        masked_positions=batch["masked_positions"],
    )  # (B, P, V), the head run at the P gathered positions only
    weights = batch["masked_weights"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["masked_ids"])  # (B, P)
    return masked_mean(losses, weights), {"masked_accuracy": masked_accuracy(logits, batch["masked_ids"], weights)}


def throughput(cfg: Config, train: mlm.MLMDataset) -> Throughput:
    """Tokens (positions, padding included) and model FLOPs per training sequence."""
    bert = bert_config(cfg, train.vocab_size)
    return {
        "tokens_per_example": float(train.seq_len),
        "flops_per_example": bert.train_flops_per_sequence(train.seq_len, data_config(cfg).max_predictions),
    }


def sequence_lengths(cfg: Config, limit: int = 512) -> np.ndarray | None:
    """Token counts (``[CLS]`` + line + ``[SEP]``, at most ``limit``) of the corpus's lines,
    as a model fed one line per example would see them: the input of ``xlafit check bert``'s
    padding plans (none for synthetic data)."""
    if data_config(cfg).source == "synthetic":
        return None
    fs, root, manifest = mlm.read_manifest(data_location(cfg))
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tokenizer.json",):
            with fs.open(f"{root}/tokenizer/{name}", "rb") as f:
                (Path(tmp) / name).write_bytes(f.read())
        tok = load_tokenizer(tmp)
    lines = [line for _, line in read_lines(manifest["inputs"]) if line]
    counts = [len(e.ids) + 2 for e in tok.encode_batch(lines, add_special_tokens=False)]
    return np.minimum(np.array(counts, np.int64), limit)


RECIPE = Recipe(
    name="bert",
    model_config=BertModelConfig,
    data_config=BertDataConfig,
    load_data=load_data,
    from_data=from_data,
    build_model=build_model,
    loss_fn=loss_fn,
    throughput=throughput,
    save_artifacts=save_artifacts,
    kept_files={
        "tokenizer/tokenizer.json": "tokenizer (the prepared data's); the checkpoints learned the run's token ids",
        shards.FINGERPRINT_FILE: "prepared sequences (the sha256 of each shard of its splits, from its manifest.json): "
        "the data in data.data_dir was prepared again since the run started",
    },
    sequence_lengths=sequence_lengths,
)
