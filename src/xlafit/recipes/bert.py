"""Recipe: BERT masked-LM pretraining (seed 001), data-parallel on every device.

Config + model + data wiring: the tokenizer and shards come from ``xlafit tokenizer train``
and ``xlafit data mlm`` (or, with no ``data.data_dir``, from the Korean demo corpus, built
once into the user cache), masks are drawn per batch by :class:`~xlafit.data.mlm.MLMDataset`,
the loop is :class:`xlafit.Trainer`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import jax
import numpy as np
import optax
from flax import nnx

from xlafit import config as xconfig
from xlafit.cache import cache_dir
from xlafit.config import Config, ConfigError
from xlafit.data import mlm
from xlafit.data.text import korean_demo_files, read_lines
from xlafit.data.tokenizer import TRAINER_VERSION, load_tokenizer, train_tokenizer
from xlafit.models.bert import PRESETS, BertConfig, BertForMaskedLM
from xlafit.train.losses import masked_accuracy, masked_mean


@dataclasses.dataclass
class ModelConfig:
    preset: Literal["tiny", "mini", "small", "medium", "base", "large", "custom"] = "tiny"
    num_layers: int | None = None  # null: the preset's
    hidden_size: int | None = None
    num_heads: int | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int = 512
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.0
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    dropout_bits: Literal[16, 32] = 16  # random bits per dropout decision; 32 = nnx.Dropout's draw
    init_from_hf: str | None = None  # a Hugging Face BERT directory to continue pretraining


@dataclasses.dataclass
class DataConfig(xconfig.DataConfig):
    """``data_dir``: a directory or URL written by ``xlafit data mlm`` (null: the demo)."""

    seq_len: int = 128
    vocab_size: int = 2000  # the demo tokenizer's size
    packing: Literal["sentences", "pairs"] = "sentences"
    mask_prob: float = 0.15
    max_predictions: int = 20
    whole_word_mask: bool = False
    eval_fraction: float = 0.1  # of the demo's documents


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
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


# --------------------------------------------------------------------------- data


def demo_data(cfg: Config) -> str:
    """Builds (once) the Korean demo's tokenizer and MLM shards; returns their directory.

    The directory's name is a hash of the settings that shape it; it is written to a
    temporary directory and renamed into place, so concurrent processes cannot see half.
    """
    d = cfg.data
    files = korean_demo_files()
    key = json.dumps([files, d.vocab_size, d.seq_len, d.packing, d.eval_fraction, d.seed, mlm.FORMAT, TRAINER_VERSION])
    target = cache_dir() / f"bert-demo-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / mlm.MANIFEST).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"building the Korean demo corpus in {target} (once)", flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tok_dir = Path(tmp) / "tok"
        tok = train_tokenizer(files, d.vocab_size, tok_dir, show_progress=False)
        out = Path(tmp) / "data"
        manifest = mlm.prepare(
            str(tok_dir),
            files,
            str(out),
            seq_len=d.seq_len,
            packing=d.packing,
            doc_boundary="blank",
            eval_fraction=d.eval_fraction,
            seed=d.seed,
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


def data_location(cfg: Config) -> str:
    return cfg.data.data_dir or demo_data(cfg)


def load_data(cfg: Config) -> tuple[mlm.MLMDataset, mlm.MLMDataset]:
    """(train, eval) masked-LM datasets; eval masks stay fixed (epoch 0)."""
    d = cfg.data
    where = data_location(cfg)
    masking = mlm.MaskingConfig(d.mask_prob, d.max_predictions, d.whole_word_mask, d.seed)
    train = mlm.MLMDataset.from_prepared(where, "train", masking)
    evaluation = mlm.MLMDataset.from_prepared(where, "eval", masking)
    if train.seq_len != d.seq_len:
        raise ConfigError(
            f"data.seq_len={d.seq_len} but {where} holds sequences of {train.seq_len} tokens; "
            f"set data.seq_len={train.seq_len} or prepare the data again with --seq-len {d.seq_len}."
        )
    return train, evaluation


def save_artifacts(cfg: Config, run_dir: Path, train: mlm.MLMDataset) -> None:
    """Copies the tokenizer into ``run_dir/tokenizer``, for ``xlafit export hf``."""
    fs, root, _ = mlm.read_manifest(train.location)
    dest = run_dir / "tokenizer"
    dest.mkdir(parents=True, exist_ok=True)
    for name in fs.ls(f"{root}/tokenizer", detail=False):
        with fs.open(name, "rb") as f:
            (dest / Path(name).name).write_bytes(f.read())


# --------------------------------------------------------------------------- model


def build_model(cfg: Config, train: mlm.MLMDataset) -> BertForMaskedLM:
    bert = bert_config(cfg, train.vocab_size)
    if cfg.model.init_from_hf:
        model = BertForMaskedLM.from_hf(
            cfg.model.init_from_hf,
            rngs=nnx.Rngs(params=cfg.trainer.seed, dropout=cfg.trainer.seed + 1),
            hidden_dropout=bert.hidden_dropout,
            attention_dropout=bert.attention_dropout,
            dtype=bert.dtype,
            attention=bert.attention,
            dropout_bits=bert.dropout_bits,
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


def throughput(cfg: Config, train: mlm.MLMDataset) -> dict[str, float]:
    """Tokens (positions, padding included) and model FLOPs per training sequence."""
    bert = bert_config(cfg, train.vocab_size)
    return {
        "tokens_per_example": float(train.seq_len),
        "flops_per_example": bert.train_flops_per_sequence(train.seq_len, cfg.data.max_predictions),
    }


# --------------------------------------------------------------------------- export


def export_hf(run_dir: str | Path, out: str | Path, step: int | None = None) -> tuple[Path, int]:
    """Writes a run's parameters (checkpoint ``step``, default the newest intact one) as a
    Hugging Face ``BertForMaskedLM`` directory, tokenizer included. Returns (out, step).
    """
    import yaml

    from xlafit.checkpoint import Checkpointer, CheckpointError, path_name
    from xlafit.models.bert_hf import save_hf
    from xlafit.recipes import checkpoint_dir, config_from_dict

    run = Path(run_dir)
    if not (run / "config.yaml").exists():
        raise ConfigError(f"{run} is not a run directory (no config.yaml).")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    if saved.get("recipe") != "bert":
        raise ConfigError(f"{run} is a {saved.get('recipe')!r} run; only bert runs export to Hugging Face.")
    tok_dir = run / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        raise ConfigError(f"{run} has no tokenizer/ (written when training starts); cannot export.")
    cfg = config_from_dict("bert", {k: v for k, v in saved.items() if k != "recipe"})
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]
    model = BertForMaskedLM(bert_config(cfg, len(vocab)), rngs=nnx.Rngs(0))
    ckpt = Checkpointer(checkpoint_dir(cfg, run))
    try:
        usable = [i.step for i in ckpt.list() if i.usable]
        if step is None:
            if not usable:
                raise CheckpointError(f"{run} has no intact checkpoint to export.")
            step = usable[-1]
        elif step not in usable:
            raise CheckpointError(f"no intact checkpoint {step} in {run}; intact: {usable}.")
        raw = {path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(ckpt.restore_params(step))[0]}
    finally:
        ckpt.close()
    params = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, [raw[path_name(p)] for p, _ in leaves]))
    out = save_hf(model, out, tokenizer_dir=tok_dir)
    shutil.copy2(run / "config.yaml", out / "xlafit-config.yaml")
    return out, step


def sequence_lengths(cfg: Config, limit: int = 512) -> np.ndarray:
    """Token counts (``[CLS]`` + line + ``[SEP]``, at most ``limit``) of the corpus's lines,
    as a model fed one line per example would see them: the input of ``xlafit check bert``'s
    padding plans."""
    fs, root, manifest = mlm.read_manifest(data_location(cfg))
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tokenizer.json",):
            with fs.open(f"{root}/tokenizer/{name}", "rb") as f:
                (Path(tmp) / name).write_bytes(f.read())
        tok = load_tokenizer(tmp)
    lines = [line for _, line in read_lines(manifest["inputs"]) if line]
    counts = [len(e.ids) + 2 for e in tok.encode_batch(lines, add_special_tokens=False)]
    return np.minimum(np.array(counts, np.int64), limit)
