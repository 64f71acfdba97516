"""Recipe: a Llama-architecture causal language model, trained or fine-tuned (full or LoRA).

Config + model + data wiring: documents from ``data.data_dir`` (text or Parquet files) go
through a Hugging Face tokenizer and are packed into rows with segment ids
(:mod:`xlafit.data.clm`); the model is :class:`~xlafit.models.llama.LlamaForCausalLM`, new
or read from a Hugging Face directory (``model.init_from_hf``); ``lora.rank`` trains
adapters on a frozen base (:func:`xlafit.run.with_lora`). With no ``data.data_dir``, the
demo: the Korean texts of the konlpy wheel, a byte-level BPE tokenizer trained on them once
(into the user cache), and a tiny Llama. ``model.objective=dpo`` (``simpo``, ``orpo``) tunes
on preference pairs instead (:mod:`xlafit.recipes.llm_preference`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

import jax
import optax
from flax import nnx

from xlafit import config as xconfig
from xlafit.config import Config
from xlafit.data import chat, chat_demo, clm
from xlafit.data.text import korean_demo_files
from xlafit.errors import ConfigError, HFFormatError
from xlafit.hf import llama as llama_hf
from xlafit.hf.files import read_json
from xlafit.io import hub
from xlafit.io.cache import cache_dir
from xlafit.models.attention import packed_segments_limit
from xlafit.models.llama import PRESETS, LlamaConfig, LlamaForCausalLM
from xlafit.parallel.sharding import constrain
from xlafit.recipes import llm_preference
from xlafit.recipes.base import Recipe, Throughput
from xlafit.train.losses import chunked_cross_entropy, masked_accuracy, masked_mean

DEMO_VOCAB_SIZE = 2000  # the demo's BPE tokenizer
DATA_FORMAT_FILE = "data_format.json"  # the format of the data a run trained on (chat, prompt_completion, text)
_SIZES = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size")
_OPTIONAL = ("max_position_embeddings", "head_dim", "vocab_size")  # sizes that a preset supplies when not given


@dataclasses.dataclass
class LlmModelConfig:
    # Llama's sizes by name (tiny: 2 layers of 64 for tests and the demo; llama-3.2-1b and
    # llama-3.1-8b: Meta's), or custom: the sizes below
    preset: Literal["tiny", "llama-3.2-1b", "llama-3.1-8b", "gemma-3-1b", "qwen3-1.7b", "custom"] = "tiny"
    num_layers: int | None = None  # null: the preset's
    hidden_size: int | None = None  # null: the preset's
    num_heads: int | None = None  # query heads; null: the preset's
    num_kv_heads: int | None = None  # key/value heads (fewer: grouped-query attention); null: the preset's
    intermediate_size: int | None = None  # the SwiGLU MLP's width; null: the preset's
    max_position_embeddings: int | None = None  # the longest sequence; null: the preset's
    head_dim: int | None = None  # per attention head; null: the preset's (custom: hidden_size / num_heads)
    vocab_size: int | None = None  # null: the preset's (tiny and custom: the tokenizer's)
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16: mixed precision (parameters stay float32)
    # the attention kernel: auto takes splash (flash, TPUs; seq_len a multiple of 128) or
    # cudnn (flash, GPUs; unpacked bf16) where it applies, else xla; cudnn: packed rows too (bf16)
    attention: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    # a Hugging Face Llama (or Qwen2) directory to start from (config.json + safetensors):
    # its sizes replace the preset's, and its tokenizer.json is the default data.tokenizer
    init_from_hf: str | None = None
    revision: str | None = None  # a hub id's branch, tag or commit (model.init_from_hf, data.tokenizer)
    # Recompute activations in the backward pass, per decoder layer: none, full, or a
    # jax.checkpoint_policies name (dots_saveable, ...; models/bert.py: REMAT_POLICIES).
    remat: str = "none"
    scan_layers: bool = False  # nnx.scan over the decoder layers: one layer compiled instead of num_layers
    # the loss over chunks of this many positions (0: all at once): holds [batch, chunk, vocab]
    # float32 logits instead of [batch, seq_len, vocab], for a third more output-layer FLOPs
    logits_chunk: int = 0
    # next_token (pretraining, SFT), or a preference objective on pairs of completions: dpo, simpo, orpo
    objective: Literal["next_token", "dpo", "simpo", "orpo"] = "next_token"
    # the preference objectives' settings: beta, label_smoothing, gamma, reference (docs/guides/preference.md)
    preference: llm_preference.PreferenceConfig = dataclasses.field(default_factory=llm_preference.PreferenceConfig)


@dataclasses.dataclass
class LlmDataConfig(xconfig.DataConfig):
    """``data_dir``: text files (documents separated by blank lines) or Parquet files, a file,
    directory, glob or URL (null: the Korean demo corpus)."""

    seq_len: int = 256  # tokens per packed row (documents longer than this are cut into pieces)
    # a Hugging Face tokenizer.json, or a directory holding one; null: model.init_from_hf's,
    # else (the demo) a byte-level BPE trained on the corpus
    tokenizer: str | None = None
    vocab_size: int | None = None  # the size of the BPE tokenizer the demo trains (null: 2000)
    text_column: str = "text"  # the column of Parquet files that holds the documents
    eval_fraction: float = 0.1  # documents held out for evaluation (a hash of their index and data.seed)
    # auto (from the records), text, chat ({"messages": [...]}), prompt_completion ({"prompt", "completion"})
    # or preference ({"prompt", "chosen", "rejected"}: model.objective=dpo, simpo, orpo)
    format: str = "auto"
    # chat records: a Jinja chat template file instead of the tokenizer's (tokenizer_config.json's chat_template),
    # or one of xlafit's training templates by name (qwen3, mistral-v0.3; see xlafit/data/templates.py)
    chat_template: str | None = None
    loss_on: str = "assistant"  # chat and prompt/completion records: assistant (the answers only) or all
    # with no data.data_dir: korean (the konlpy wheel's texts), chat (arithmetic conversations with a ChatML
    # tokenizer), arithmetic (the same kind of questions and answers as plain text, the same tokenizer) or
    # preference (sums with a right answer chosen and a wrong one rejected: model.objective=dpo)
    demo: Literal["korean", "chat", "arithmetic", "preference"] = "korean"

    def __post_init__(self) -> None:
        super().__post_init__()
        xconfig.check_fraction(self.eval_fraction, "data.eval_fraction")


def data_config(cfg: Config) -> LlmDataConfig:
    """``cfg.data`` as this recipe's :class:`LlmDataConfig` (its own keys typed)."""
    if not isinstance(cfg.data, LlmDataConfig):
        raise TypeError(f"an llm config has an LlmDataConfig, got {type(cfg.data).__name__}")
    return cfg.data


def llama_config(cfg: Config, vocab_size: int) -> LlamaConfig:
    """The model's :class:`LlamaConfig`: the preset's sizes, then the config's overrides;
    ``vocab_size`` is the tokenizer's for tiny and custom sizes (Meta's presets keep theirs)."""
    m = cfg.model
    sizes = _given_sizes(m)
    if m.preset == "custom":
        missing = [k for k in _SIZES if k not in sizes and k != "num_kv_heads"]
        if missing:
            raise ConfigError(f"model.preset=custom needs {', '.join('model.' + k for k in missing)}.")
        base: dict[str, Any] = {"vocab_size": vocab_size}
    else:
        base = dict(PRESETS[m.preset])
        if m.preset == "tiny":
            base["vocab_size"] = vocab_size
    if sizes.get("vocab_size", base["vocab_size"]) < vocab_size:
        raise ConfigError(
            f"the tokenizer has {vocab_size} tokens, more than the model's vocabulary of "
            f"{sizes.get('vocab_size', base['vocab_size'])}; use that model's tokenizer (data.tokenizer) or "
            + ("" if m.preset == "custom" else "model.preset=custom with ")
            + f"model.vocab_size={vocab_size} or more."
        )
    try:
        return LlamaConfig(
            **{**base, **sizes},
            dtype=m.compute_dtype,
            attention=m.attention,
            remat=m.remat,
            scan_layers=m.scan_layers,
            logits_chunk=m.logits_chunk,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def validate(cfg: Config) -> None:
    """Refuses sizes that cannot work and local model or tokenizer paths that are missing (or
    an xlafit run's, not a Hugging Face directory), before any text is read."""
    llm_preference.validate(cfg)
    if cfg.model.init_from_hf:
        hub.check_local(cfg.model.init_from_hf, "model.init_from_hf")
        _refuse_size_overrides(cfg)
        if hub.is_local(cfg.model.init_from_hf):  # a hub id: once it is read (from_data)
            check_checkpoint(cfg, Path(cfg.model.init_from_hf).expanduser())
    tokenizer = data_config(cfg).tokenizer
    if tokenizer:
        hub.check_local(tokenizer, "data.tokenizer")
    if cfg.model.init_from_hf is None:
        config = llama_config(cfg, 1)
        if data_config(cfg).seq_len > config.max_position_embeddings:
            raise ConfigError(
                f"data.seq_len={data_config(cfg).seq_len} is longer than the model's max_position_embeddings="
                f"{config.max_position_embeddings}; lower data.seq_len or raise model.max_position_embeddings."
            )


def _given_sizes(m: Any) -> dict[str, int]:
    """The model sizes the config sets (the rest come from the preset or the checkpoint)."""
    return {k: getattr(m, k) for k in (*_SIZES, *_OPTIONAL) if getattr(m, k) is not None}


def _refuse_size_overrides(cfg: Config) -> None:
    """Refuses a size given with ``model.init_from_hf`` that differs from its ``config.json``:
    the checkpoint's sizes are the model's, and an override would be recorded but not used."""
    m = cfg.model
    given = _given_sizes(m)
    if not given:
        return  # nothing to compare: no need to read (or download) the checkpoint's config
    config = Path(str(model_dir(cfg))).expanduser() / "config.json"
    if not config.exists():
        return  # llama_hf.from_hf names what is missing
    checkpoint = llama_hf.config_from_hf(read_json(config))
    differ = {k: v for k, v in given.items() if v != getattr(checkpoint, k)}
    if differ:
        key, value = next(iter(differ.items()))
        raise ConfigError(
            f"model.{key}={value} conflicts with model.init_from_hf={m.init_from_hf}, whose config.json has "
            f"{getattr(checkpoint, key)}; its sizes are the checkpoint's: drop model.{key}, or drop "
            "model.init_from_hf to train a new model of that size."
        )


def check_checkpoint(cfg: Config, folder: str | Path) -> None:
    """``model.init_from_hf``'s ``config.json`` (in ``folder``) read before the run directory
    is written: a model family xlafit does not read, missing or damaged weights (their
    safetensors headers are read), or ``data.seq_len`` beyond the positions the checkpoint was
    trained on, is refused. A local directory is checked with the config (:func:`validate`), a
    hub id once it is read (:func:`from_data`)."""
    m = cfg.model
    folder = Path(folder)
    try:
        if not (folder / "config.json").is_file():
            raise HFFormatError(
                f"{folder} has no config.json; give a directory written by save_pretrained or xlafit export hf."
            )
        checkpoint = llama_hf.config_from_hf(read_json(folder / "config.json"))
        llama_hf.tensor_files(folder)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model.init_from_hf={m.init_from_hf}: {e}") from None
    seq_len = data_config(cfg).seq_len
    if seq_len > checkpoint.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={seq_len} is longer than model.init_from_hf={m.init_from_hf}'s max_position_embeddings="
            f"{checkpoint.max_position_embeddings} (its config.json): the model never saw positions that far; lower "
            "data.seq_len."
        )


def from_data(cfg: Config, train: clm.PackedText) -> Config:
    """Checks a hub ``model.init_from_hf`` (:func:`check_checkpoint`), read by now with the
    data's tokenizer or here, before the run directory is written."""
    name = cfg.model.init_from_hf
    if name and not hub.is_local(name):  # a local directory was checked with the config (validate)
        check_checkpoint(cfg, str(model_dir(cfg)))
    return cfg


# --------------------------------------------------------------------------- data


def model_dir(cfg: Config) -> str | None:
    """``model.init_from_hf`` as a local directory: a hub id downloaded into the Hugging Face
    cache first (:func:`xlafit.io.hub.resolve`); None when the model starts from scratch."""
    name = cfg.model.init_from_hf
    return _resolved(name, cfg.model.revision, "model.init_from_hf") if name else None


@functools.cache
def _resolved(name: str, revision: str | None, what: str) -> str:
    return hub.resolve(name, revision, what)


def tokenizer_location(cfg: Config) -> str:
    """Where the run's ``tokenizer.json`` is: ``data.tokenizer`` (a hub id read from the
    Hugging Face cache), ``model.init_from_hf``'s, or the demo's BPE (trained once into the
    user cache)."""
    d = data_config(cfg)
    if d.tokenizer:
        return _resolved(d.tokenizer, cfg.model.revision, "data.tokenizer")
    source = model_dir(cfg)
    if source and (Path(source).expanduser() / "tokenizer.json").exists():
        return str(Path(source).expanduser())
    if not d.data_dir and d.demo in ("chat", "arithmetic", "preference"):
        return chat_demo.demo_files()[2]
    if d.data_dir:
        raise ConfigError(
            "data.data_dir needs a tokenizer: set data.tokenizer (a tokenizer.json or a directory holding one), "
            "or model.init_from_hf to a directory that has one."
        )
    return demo_tokenizer(d.vocab_size or DEMO_VOCAB_SIZE)


def demo_tokenizer(vocab_size: int) -> str:
    """The demo's byte-level BPE on the Korean corpus, trained once into the user cache."""
    files = korean_demo_files()
    key = json.dumps(["bpe-1", files, vocab_size])
    target = cache_dir() / f"llm-demo-tokenizer-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / "tokenizer.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tok = clm.train_bpe(files, vocab_size, tmp)
        print(
            f"trained the demo's BPE tokenizer ({tok.get_vocab_size()} tokens) into {target} (once)",
            file=sys.stderr,
            flush=True,
        )
        try:
            Path(tmp).rename(target)
        except OSError:  # another process finished first
            if not (target / "tokenizer.json").exists():
                raise
    return str(target)


def load_data(cfg: Config) -> tuple[clm.PackedText, clm.PackedText]:
    """(train, eval) packed rows of the documents of ``data.data_dir`` (or the demo corpus);
    for a preference objective, pairs of rows (:func:`xlafit.recipes.llm_preference.load`)."""
    d = data_config(cfg)
    where = tokenizer_location(cfg)
    tok = clm.load_tokenizer(where)
    inputs = [d.data_dir] if d.data_dir else _demo_inputs(d.demo)
    # The template the conversations are rendered with: a family's training template in place of
    # its official one where xlafit ships one (data/templates.py); data.chat_template wins.
    template = chat.template_for(where, d.chat_template, training=True)
    if llm_preference.objective_of(cfg) is not None:
        pairs = llm_preference.load(cfg, tok, template, build_llama)
        return pairs[0], (pairs[1] if len(pairs[1]) else None)  # type: ignore[return-value]
    train, evaluation = clm.load_packed(
        inputs,
        tok,
        seq_len=d.seq_len,
        eval_fraction=d.eval_fraction,
        seed=d.seed,
        text_column=d.text_column,
        fmt=d.format,
        template=template,
        loss_on=d.loss_on,
        progress=functools.partial(print, file=sys.stderr, flush=True),
    )
    summary = data_summary(train, evaluation, d)
    if train.source is not None and train.source.format == "chat":
        summary += f"\n  {chat.describe(template)}"
    print(summary, flush=True, file=sys.stderr)
    if cfg.model.attention == "cudnn":
        check_packed_segments(train, evaluation)
    return train, (evaluation if len(evaluation) else None)  # type: ignore[return-value]


def check_packed_segments(*datasets: clm.PackedText) -> None:
    """cuDNN's packed attention takes a fixed number of segments a row
    (:func:`~xlafit.models.attention.packed_segments_limit`): refuses data that packs more."""
    for data in datasets:
        segments = data.arrays["segment_ids"]
        if not len(segments):
            continue
        most, limit = int(segments.max()), packed_segments_limit(data.seq_len)
        if most > limit:
            raise ConfigError(
                f"model.attention=cudnn takes up to {limit} documents packed in a row of {data.seq_len} tokens; "
                f"this data packs up to {most}. Use model.attention=xla (or auto), or a shorter data.seq_len."
            )


def _demo_inputs(demo: str) -> list[str]:
    records, text, _ = chat_demo.demo_files()
    return {"chat": [records], "arithmetic": [text]}.get(demo) or korean_demo_files()


def data_summary(train: clm.PackedText, evaluation: clm.PackedText, d: LlmDataConfig) -> str:
    """What the run will train on, what the loss counts, and an empty evaluation said aloud."""
    source = train.source
    kind = "documents" if source is None or source.format == "text" else f"{source.format} records"
    lines = [
        f"data: {train.documents} {kind} -> {len(train)} rows of {d.seq_len} tokens "
        f"({train.tokens / max(train.arrays['input_ids'].size, 1):.1%} not padding); eval: {evaluation.documents} "
        f"{kind}, {len(evaluation)} rows"
    ]
    if source is not None and source.format != "text":
        counted = "every token" if d.loss_on == "all" else f"the answers: {source.answer_share:.0%} of the tokens"
        lines.append(f"  loss on {counted} (data.loss_on={d.loss_on})")
        if source.truncated:
            lines.append(
                f"  {source.truncated} records longer than data.seq_len={d.seq_len} are cut at it; raise data.seq_len "
                "to keep their ends"
            )
    if not len(evaluation) and d.eval_fraction > 0:
        total = train.documents + evaluation.documents
        lines.append(
            f"  no evaluation: none of the {total} {kind} was drawn for it at data.eval_fraction={d.eval_fraction} "
            "(no eval loss or perplexity will be reported); give more data or a larger data.eval_fraction, or "
            "data.eval_fraction=0 to train without one"
        )
    return "\n".join(lines)


def save_artifacts(cfg: Config, run_dir: Any, train: clm.PackedText) -> None:
    """Copies the tokenizer into ``run_dir/tokenizer`` (local or a URL), with its chat
    template and special tokens where it has them, for ``xlafit export hf`` and generation;
    records the data's format in ``run_dir/data_format.json`` (``xlafit generate`` asks a run
    that trained on chat records through the template, any other with the text as it is), and
    for chat records the template they were rendered with. A training template that stood in
    for the tokenizer's official one (:mod:`xlafit.data.templates`) is recorded by name; the
    run's tokenizer keeps the official one, which the model is asked with.

    A chat run whose template closes the assistant's turn with another special token than the
    tokenizer's ``eos_token`` (ChatML's ``<|im_end|>`` with a tokenizer that ends documents
    with ``</s>``) records that token as its ``eos_token``, as chat models on the hub do, so
    that generation stops at the end of the turn; not where the template itself renders
    ``eos_token``, which must stay what the run trained on.
    """
    dest = run_dir / "tokenizer"
    dest.mkdir(parents=True, exist_ok=True)
    where = tokenizer_location(cfg)
    (dest / "tokenizer.json").write_text(clm.tokenizer_json(where))
    fmt = train.source.format if train.source is not None else "text"
    trained = chat.template_for(where, data_config(cfg).chat_template, training=True)
    recorded: dict[str, Any] = {"format": fmt}
    if fmt == "chat" and trained is not None:
        recorded["chat_template"] = {
            "rendered_with": trained.name,
            "shipped": trained.shipped.name if trained.shipped is not None else None,
            "in_place_of": trained.official.name if trained.official is not None else None,
        }
    (run_dir / DATA_FORMAT_FILE).write_text(json.dumps(recorded) + "\n")
    template = trained.official if trained is not None and trained.official is not None else trained
    if template is not None:  # what the run's chat data was rendered with, for generation and export
        (dest / chat.TEMPLATE_FILE).write_text(template.source)
        tokens = dict(template.tokens)
        end = chat.end_of_turn(template, clm.load_tokenizer(where))
        if fmt == "chat" and end is not None and "eos_token" not in template.source:
            tokens["eos_token"] = end
        (dest / "tokenizer_config.json").write_text(json.dumps(tokens, indent=2) + "\n")


# --------------------------------------------------------------------------- model


def build_llama(cfg: Config, vocab_size: int) -> LlamaForCausalLM:
    """The model: read from ``model.init_from_hf``, or new with the preset's sizes."""
    m = cfg.model
    source = model_dir(cfg)
    if source:
        options = {
            "dtype": m.compute_dtype,
            "attention": m.attention,
            "remat": m.remat,
            "scan_layers": m.scan_layers,
            "logits_chunk": m.logits_chunk,
        }
        model = llama_hf.from_hf(source, rngs=nnx.Rngs(cfg.trainer.seed), **options)
        if model.cfg.vocab_size < vocab_size:
            raise ConfigError(
                f"{m.init_from_hf} has a vocabulary of {model.cfg.vocab_size} tokens, the tokenizer {vocab_size}; "
                "use the checkpoint's own tokenizer (data.tokenizer)."
            )
        return model
    return LlamaForCausalLM(llama_config(cfg, vocab_size), rngs=nnx.Rngs(params=cfg.trainer.seed))


def build_model(cfg: Config, train: clm.PackedText) -> LlamaForCausalLM:
    return build_llama(cfg, train.vocab_size)


def loss_fn(model: LlamaForCausalLM, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-row mean next-token cross-entropy over real tokens of one piece, and its accuracy."""
    # (B, T - 1); chat and prompt/completion data count their answers only (loss_mask)
    targets, weights = clm.next_token_targets(batch["input_ids"], batch["segment_ids"], batch.get("loss_mask"))
    if model.cfg.logits_chunk:  # the logits a chunk of positions at a time (model.logits_chunk)
        hidden = model.decode(batch["input_ids"], batch["segment_ids"], batch["positions"])

        def piece_logits(h: jax.Array) -> jax.Array:
            return constrain(model.logits(h), "batch", None, "vocab")

        loss, accuracy = chunked_cross_entropy(piece_logits, hidden[:, :-1], targets, weights, model.cfg.logits_chunk)
        return loss, {"token_accuracy": accuracy}
    logits = model(batch["input_ids"], batch["segment_ids"], batch["positions"])  # (B, T, V) float32
    losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], targets)
    return masked_mean(losses, weights), {"token_accuracy": masked_accuracy(logits[:, :-1], targets, weights)}


def throughput(cfg: Config, train: clm.PackedText) -> Throughput:
    """Tokens (positions, padding included) and model FLOPs (PaLM's 6N + attention) per row."""
    source = model_dir(cfg)
    llama = llama_config(cfg, train.vocab_size) if not source else None
    if llama is None:
        assert source is not None
        hf = read_json(Path(source).expanduser() / "config.json")
        llama = llama_hf.config_from_hf(hf)
    t = train.seq_len
    if llm_preference.objective_of(cfg) is not None:  # an example is a pair of rows; DPO may add the base's forward
        flops = 2 * t * llama.train_flops_per_token(t) * (1 + llm_preference.reference_passes(cfg) / 3)
        return {"tokens_per_example": 2.0 * t, "flops_per_example": flops}
    return {"tokens_per_example": float(t), "flops_per_example": t * llama.train_flops_per_token(t)}


RECIPE = Recipe(
    name="llm",
    model_config=LlmModelConfig,
    data_config=LlmDataConfig,
    load_data=load_data,
    from_data=from_data,
    build_model=build_model,
    loss_fn=loss_fn,
    loss_for=functools.partial(llm_preference.loss_for, next_token=loss_fn),
    throughput=throughput,
    save_artifacts=save_artifacts,
    kept_files={
        "tokenizer/tokenizer.json": "tokenizer (data.tokenizer, else model.init_from_hf's); the checkpoints learned "
        "the run's token ids"
    },
    validate=validate,
)
