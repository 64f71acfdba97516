"""Recipe: a Llama-architecture causal language model, trained or fine-tuned (full or LoRA).

Config + model + data wiring: documents from ``data.data_dir`` (text or Parquet files) go
through a Hugging Face tokenizer and are packed into rows with segment ids
(:mod:`xlafit.data.clm`); the model is :class:`~xlafit.models.llama.LlamaForCausalLM`, new
or read from a Hugging Face directory (``model.init_from_hf``); ``lora.rank`` trains
adapters on a frozen base (:func:`xlafit.run.with_lora`). With no ``data.data_dir``, the
demo: the Korean texts of the konlpy wheel, a byte-level BPE tokenizer trained on them once
(into the user cache), and a tiny Llama. The data wiring is :mod:`xlafit.recipes.llm_data`'s.
``model.objective=dpo`` (``simpo``, ``orpo``) tunes on preference pairs instead
(:mod:`xlafit.recipes.llm_preference`); ``model.objective=grpo`` on prompts, with rewards
for the completions the model samples (:mod:`xlafit.recipes.llm_grpo`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from xlafit.config import Config
from xlafit.data import clm, files
from xlafit.errors import ConfigError, HFFormatError
from xlafit.hf import config_json, peft
from xlafit.hf import llama as llama_hf
from xlafit.hf.files import read_json
from xlafit.hf.quantized import from_hf_quantized, tiled_shapes
from xlafit.io import hub
from xlafit.models.llama import PRESETS, LlamaConfig, LlamaForCausalLM
from xlafit.models.moe import RouterStats, load_balancing_loss, router_z_loss
from xlafit.models.quantized import check_tilings
from xlafit.parallel.sharding import active_layout, batch_axes, constrain
from xlafit.platform.hardware import table_memory
from xlafit.platform.host_memory import materialized_on_cpu, refuse_beyond, state_bytes
from xlafit.recipes import llm_data, llm_grpo, llm_preference
from xlafit.recipes.base import Recipe, Throughput, reading_shapes_only
from xlafit.recipes.llm_data import LlmDataConfig, data_config, model_dir, save_artifacts
from xlafit.recipes.llm_settings import (
    LlmModelConfig,
    warn_expert_settings_on_dense,
    warn_unused_settings,
)
from xlafit.train.losses import (
    blocks_for,
    blockwise_cross_entropy,
    blockwise_token_logps,
    evaluated_rows,
    masked_accuracy,
    masked_mean,
    token_logps_of,
    whole_logits_bytes,
)
from xlafit.train.report import EXPERT_TOKENS
from xlafit.train.step import WEIGHT

log = logging.getLogger("xlafit")

_SIZES = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size")
_OPTIONAL = ("max_position_embeddings", "head_dim", "vocab_size")  # sizes that a preset supplies when not given


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
        if m.preset in ("tiny", "tiny-moe"):
            base["vocab_size"] = vocab_size
        if base.get("layer_types") and sizes.get("num_layers", base["num_layers"]) != len(base["layer_types"]):
            base["layer_types"] = repeat_pattern(base["layer_types"], sizes["num_layers"])
    if sizes.get("vocab_size", base["vocab_size"]) < vocab_size:
        raise ConfigError(
            f"the tokenizer has {vocab_size} tokens, more than the model's vocabulary of "
            f"{sizes.get('vocab_size', base['vocab_size'])}; use that model's tokenizer (data.tokenizer) or "
            + ("" if m.preset == "custom" else "model.preset=custom with ")
            + f"model.vocab_size={vocab_size} or more."
        )
    try:
        return LlamaConfig(
            **{**base, **sizes, **moe_options(m)},  # model.moe.* over a MoE preset's own (its aux loss weight)
            dtype=m.compute_dtype,
            attention=m.attention,
            remat=m.remat,
            scan_layers=m.scan_layers,
            logits_chunk=m.logits_chunk,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def repeat_pattern(layer_types: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """A preset's per-layer kinds for ``num_layers`` layers: its repeating block (the shortest
    one that makes the whole list) laid out again, so that a smaller or larger model of a
    family keeps its pattern (Gemma 3's five sliding-window layers and a global one).

    Example:
        >>> repeat_pattern(("sliding", "sliding", "full", "sliding", "sliding", "full", "sliding"), 4)
        ('sliding', 'sliding', 'full', 'sliding')
    """
    period = next(p for p in range(1, len(layer_types) + 1) if all(
        t == layer_types[i % p] for i, t in enumerate(layer_types)
    ))  # fmt: skip
    return tuple(layer_types[i % period] for i in range(num_layers))


def moe_options(m: LlmModelConfig) -> dict[str, Any]:
    """The :class:`LlamaConfig` fields ``model.moe`` sets (a checkpoint's or preset's
    ``router_aux_loss_coef`` kept unless given)."""
    options: dict[str, Any] = {"moe_impl": m.moe.impl, "router_z_loss_coef": m.moe.router_z_loss_coef}
    if m.moe.router_aux_loss_coef is not None:
        options["router_aux_loss_coef"] = m.moe.router_aux_loss_coef
    return options


def validate(cfg: Config) -> None:
    """Refuses sizes that cannot work and local model or tokenizer paths that are missing (or
    an xlafit run's, not a Hugging Face directory), before any text is read."""
    llm_preference.validate(cfg)
    llm_grpo.validate(cfg)
    warn_unused_settings(cfg)
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
        check_base_blocks(cfg, config)
        warn_expert_settings_on_dense(cfg, config, f"model.preset={cfg.model.preset}")
        if cfg.model.objective != "grpo" and data_config(cfg).seq_len > config.max_position_embeddings:
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
    checkpoint = config_json.config_from_hf(read_json(config))
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
    hub id once it is read (:func:`from_data`). A check that compiles for shapes alone
    (:func:`~xlafit.recipes.base.shapes_only`) needs ``config.json``, not the weights."""
    m = cfg.model
    folder = Path(folder)
    try:
        if not (folder / "config.json").is_file():
            if (base := peft.adapter_base(folder)) is not None:
                raise HFFormatError(f"{peft.not_a_model_but_an_adapter(folder, base)}.")
            raise HFFormatError(
                f"{folder} has no config.json; give a directory written by save_pretrained or xlafit export hf."
            )
        checkpoint = config_json.config_from_hf(read_json(folder / "config.json"))
        if not reading_shapes_only():
            llama_hf.tensor_files(folder)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model.init_from_hf={m.init_from_hf}: {e}") from None
    check_base_blocks(cfg, checkpoint)
    warn_expert_settings_on_dense(cfg, checkpoint, f"model.init_from_hf={m.init_from_hf}")
    seq_len = data_config(cfg).seq_len
    if m.objective != "grpo" and seq_len > checkpoint.max_position_embeddings:  # GRPO: checked per prompt
        raise ConfigError(
            f"data.seq_len={seq_len} is longer than model.init_from_hf={m.init_from_hf}'s max_position_embeddings="
            f"{checkpoint.max_position_embeddings} (its config.json): the model never saw positions that far; lower "
            "data.seq_len."
        )
    if not reading_shapes_only():  # a check compiles for shapes: any tokenizer of the size serves
        _refuse_the_demo_tokenizer(cfg, folder)


def _refuse_the_demo_tokenizer(cfg: Config, folder: Path) -> None:
    """Refuses a checkpoint without ``tokenizer.json`` whose run would tokenize its data with
    xlafit's demo tokenizer (its token ids are not the ones the model learned), unless the run
    names a tokenizer (``data.tokenizer``) or the demo's own size (``data.vocab_size``: a model
    made for the demo's tokenizer)."""
    d = data_config(cfg)
    if d.tokenizer or d.vocab_size or d.data_dir or (folder / "tokenizer.json").exists():
        return  # a data directory without a tokenizer is refused where the tokenizer is looked for
    name = cfg.model.init_from_hf
    sentencepiece = (folder / "tokenizer.model").exists()
    raise ConfigError(
        f"model.init_from_hf={name} has no tokenizer.json"
        + (" (only a sentencepiece tokenizer.model, which xlafit does not read)" if sentencepiece else "")
        + ", so the run would tokenize its data with xlafit's demo tokenizer, whose token ids mean nothing to this "
        f"model: write its tokenizer beside it (transformers: AutoTokenizer.from_pretrained(...).save_pretrained"
        f"('{folder}')), or name it with data.tokenizer=org/name or a directory holding a tokenizer.json."
    )


def check_base_blocks(cfg: Config, llama: LlamaConfig) -> None:
    """A quantized base (``lora.base_dtype=nf4|int4|int8``) needs every dense layer's input
    features to be a multiple of ``lora.base_block``: refused here, before the run directory
    is written, naming the layer and a block that divides it."""
    if not (cfg.lora.rank and cfg.lora.quantized):
        return
    shapes = tiled_shapes(nnx.eval_shape(lambda: LlamaForCausalLM(llama, rngs=nnx.Rngs(0))))  # no weight made
    if cfg.lora.quantize_embeddings:  # the tables' blocks run along each token's features
        shapes.append(("embed_tokens", (llama.hidden_size, 1)))
        if llama.per_layer_input_size:
            shapes.append(("embed_tokens_per_layer", (llama.num_layers * llama.per_layer_input_size, 1)))
    check_tilings(shapes, cfg.lora.base_block, cfg.lora.base_dtype)


def from_data(cfg: Config, train: clm.PackedText) -> Config:
    """Checks a hub ``model.init_from_hf`` (:func:`check_checkpoint`), read by now with the
    data's tokenizer or here, before the run directory is written."""
    name = cfg.model.init_from_hf
    if name and not hub.is_local(name):  # a local directory was checked with the config (validate)
        check_checkpoint(cfg, str(model_dir(cfg)))
    return llm_grpo.settle(cfg)


def shapes(cfg: Config) -> clm.PackedText | None:
    """One placeholder row of ``data.seq_len`` tokens in the vocabulary of a named model
    (Meta's, Gemma's or Qwen's preset, custom sizes with ``model.vocab_size``, or a checkpoint's
    ``config.json``), for a compile that needs shapes only: the demo corpus (the konlpy wheel's
    texts) is not read. None where the data decides (``data.data_dir``: its format may add a
    loss mask; the tiny preset, whose vocabulary is the demo tokenizer's) or ships with xlafit
    (the chat demos)."""
    d, m = data_config(cfg), cfg.model
    if d.data_dir or d.demo != "korean" or (m.preset in ("tiny", "tiny-moe") and not m.init_from_hf):
        return None
    vocab: int | None = (
        model_sizes(cfg, 0).vocab_size  # its config.json alone: a check before the weights are downloaded
        if m.init_from_hf
        else _given_sizes(m).get("vocab_size") or PRESETS.get(m.preset, {}).get("vocab_size")
    )
    if not vocab:  # custom sizes without a vocabulary: the tokenizer's
        return None
    row = np.arange(d.seq_len, dtype=np.int32)[None]
    arrays = {"input_ids": np.zeros_like(row), "segment_ids": np.ones_like(row), "positions": row}
    return clm.PackedText(arrays, vocab_size=int(vocab), documents=0)


# --------------------------------------------------------------------------- model


def build_llama(cfg: Config, vocab_size: int) -> LlamaForCausalLM:
    """The model: read from ``model.init_from_hf``, or new with the preset's sizes; on a
    CPU, one larger than the memory free is refused before it is read or made. While a check
    compiles for shapes alone (:func:`~xlafit.recipes.base.shapes_only`, inside
    ``nnx.eval_shape``), the checkpoint's model is made from its ``config.json``, its weights
    not read: ``xlafit check`` answers before they are downloaded."""
    m = cfg.model
    source = model_dir(cfg)
    if materialized_on_cpu() and not (cfg.lora.rank and cfg.lora.quantized):
        _refuse_beyond_host_memory(cfg, model_sizes(cfg, vocab_size))
    if source:
        options = llama_options(cfg)
        if reading_shapes_only():  # a 4-bit base is quantized by with_lora, as a preset's is
            model = LlamaForCausalLM(llama_hf.read_config(source, **options)[1], rngs=nnx.Rngs(cfg.trainer.seed))
        elif cfg.lora.rank and cfg.lora.quantized:  # quantized as it is read: one tensor in full precision at a time
            lora = cfg.lora
            model = from_hf_quantized(
                source, lora.base_dtype, lora.base_block, embeddings=lora.quantize_embeddings, **options
            )
        else:
            model = llama_hf.from_hf(source, rngs=nnx.Rngs(cfg.trainer.seed), **options)
        if model.cfg.vocab_size < vocab_size:
            raise ConfigError(
                f"{m.init_from_hf} has a vocabulary of {model.cfg.vocab_size} tokens, the tokenizer {vocab_size}; "
                "use the checkpoint's own tokenizer (data.tokenizer)."
            )
        return model
    return LlamaForCausalLM(llama_config(cfg, vocab_size), rngs=nnx.Rngs(params=cfg.trainer.seed))


def llama_options(cfg: Config) -> dict[str, Any]:
    """The run's settings a checkpoint's ``config.json`` leaves to it (precision, attention,
    remat, scanned layers, logits in blocks, the experts' kernels)."""
    m = cfg.model
    return {
        "dtype": m.compute_dtype,
        "attention": m.attention,
        "remat": m.remat,
        "scan_layers": m.scan_layers,
        "logits_chunk": m.logits_chunk,
        **moe_options(m),
    }


def build_from_config(cfg: Config, config: dict[str, Any]) -> LlamaForCausalLM:
    """``model.init_from_hf``'s model made from its ``config.json`` (``config``) with new
    weights, none read: for what sets them all afterwards (a full fine-tune's checkpoint)."""
    return LlamaForCausalLM(config_json.config_from_hf(config, **llama_options(cfg)), rngs=nnx.Rngs(cfg.trainer.seed))


def _refuse_beyond_host_memory(cfg: Config, sizes: LlamaConfig) -> None:
    """Refuses a model whose float32 parameters are more than this machine has free (a 9B
    preset on a notebook's CPU), naming the TPU check and the 4-bit base."""
    shapes = nnx.eval_shape(lambda: LlamaForCausalLM(sizes, rngs=nnx.Rngs(0)))
    params = nnx.state(shapes, nnx.Param)
    count = sum(math.prod(v.shape) for v in jax.tree.leaves(params))
    name = cfg.model.init_from_hf or f"model.preset={cfg.model.preset}"
    refuse_beyond(
        state_bytes(params),
        f"{name} ({count / 1e9:.2f}B parameters in float32)",
        "Ask whether a TPU holds it with `xlafit check llm --tpu colab,kaggle ...` (the TPU compiler runs here, no TPU "
        "needed); to tune it on this machine, load its base in 4 bits (lora.rank=16 lora.base_dtype=nf4), or take a "
        "smaller model.",
    )


def load_data(cfg: Config) -> tuple[clm.PackedText, clm.PackedText]:
    """(train, eval) packed rows of the documents of ``data.data_dir`` (or the demo corpus,
    :func:`xlafit.recipes.llm_data.load_data`); for a preference objective, pairs of rows
    (:func:`xlafit.recipes.llm_preference.load`)."""
    if cfg.model.objective == "grpo":  # prompts; no evaluation set (the rewards are the measure)
        e = llm_data.encoding(cfg)
        stops = clm.stop_ids(llm_data.tokenizer_location(cfg))
        context = model_sizes(cfg, e.tok.get_vocab_size()).max_position_embeddings  # a prompt past it: refused now
        prompts = llm_grpo.load(cfg, e.tok, e.template, e.markers, stops, e.inputs, context)
        return prompts, None  # type: ignore[return-value]
    if llm_preference.objective_of(cfg) is None:
        return llm_data.load_data(cfg)
    e = llm_data.encoding(cfg)
    train, evaluation = llm_preference.load(cfg, e.tok, e.template, e.markers, e.inputs, build_llama, token_logps)
    return train, (evaluation if len(evaluation) else None)  # type: ignore[return-value]


def eval_data(cfg: Config, path: str) -> clm.PackedText:
    """Every record of ``path`` as evaluation rows (pairs, for a preference objective), encoded
    as a run of ``cfg`` encodes its data: its tokenizer, template, ``data.seq_len`` and
    ``data.loss_on`` (``xlafit eval RUN --data PATH``).

    Raises:
        ConfigError: a GRPO run, which is measured by its rewards, not by a loss on records.
    """
    if cfg.model.objective == "grpo":
        raise ConfigError(
            "a GRPO run trains on the rewards of its own answers and has no loss to score held-out records with: "
            "answer held-out prompts with `xlafit generate RUN --prompts-file FILE --json` and score the answers with "
            "the run's reward functions."
        )
    # the run's own copy (its chat template as it trained, whatever its base holds now), else where it came from
    where = llm_data.kept_tokenizer(cfg) or llm_data.tokenizer_location(cfg)
    d = dataclasses.replace(data_config(cfg), data_dir=path, eval_data_dir=None, eval_fraction=0.0, tokenizer=where)
    cfg = dataclasses.replace(cfg, data=d)
    inputs = llm_data.scored_files(path)  # a folder of splits: its evaluation split
    if llm_preference.objective_of(cfg) is None:
        read = llm_data.load_data(cfg, evaluating=True, inputs=inputs)[0]
        llm_data.say_other_format(cfg, path, read)
        return read
    e = llm_data.encoding(cfg)
    pairs, _ = llm_preference.load(cfg, e.tok, e.template, e.markers, inputs, build_llama, token_logps, True)
    return pairs  # type: ignore[return-value]


def build_model(cfg: Config, train: clm.PackedText) -> LlamaForCausalLM:
    return build_llama(cfg, train.vocab_size)


def loss_fn(model: LlamaForCausalLM, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-row mean next-token cross-entropy over real tokens of one piece, and its accuracy,
    each row weighted by its tokens (:data:`xlafit.train.step.WEIGHT`): the loss the run trains
    and reports is the mean over the batch's tokens, as ``transformers`` and TRL compute it,
    whatever the packing put in each row. The logits in blocks where :func:`logits_blocks` says
    so, else whole. A mixture of experts adds its router's auxiliary losses
    (:func:`with_router_losses`). In evaluation the rows that pad the last batch are padding
    throughout (:func:`~xlafit.train.losses.evaluated_rows`), so that the router counts none of
    their tokens."""
    rows = evaluated_rows()
    if rows is not None:
        batch = {**batch, "segment_ids": jnp.where(rows[:, None] > 0, batch["segment_ids"], 0)}
    hidden, stats = model.decode_routed(batch["input_ids"], batch["segment_ids"], batch["positions"])
    loss, metrics = _next_token_loss(model, batch, hidden)
    return (loss, metrics) if stats is None else with_router_losses(model.cfg, loss, metrics, stats)


def with_router_losses(
    cfg: LlamaConfig, loss: jax.Array, metrics: dict[str, jax.Array], stats: RouterStats
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``loss`` plus ``router_aux_loss_coef`` times the load-balancing loss and
    ``router_z_loss_coef`` times the z-loss (transformers adds the first to Qwen3-MoE's loss
    the same way), each logged (``moe_aux_loss``, ``router_z_loss``), with the next-token loss
    alone (``nll_loss``: the perplexity's), and the tokens routed to each expert, averaged over
    the MoE layers (``expert_tokens/<e>``; written to metrics.jsonl and TensorBoard, not
    printed). Each router term is one value for the whole batch, repeated per row as the
    metrics' convention wants."""
    rows = loss.shape[0]
    aux, z = load_balancing_loss(stats), router_z_loss(stats)
    metrics = {**metrics, "nll_loss": loss}
    loss = loss + cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z

    def per_row(x: jax.Array) -> jax.Array:
        return jnp.broadcast_to(x, (rows,))

    metrics["moe_aux_loss"] = per_row(aux)
    if cfg.router_z_loss_coef:
        metrics["router_z_loss"] = per_row(z)
    load = stats.expert_load()
    metrics.update({f"{EXPERT_TOKENS}{e}": per_row(load[e]) for e in range(load.shape[0])})
    return loss, metrics


def _next_token_loss(
    model: LlamaForCausalLM, batch: dict[str, jax.Array], hidden: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    # (B, T - 1); chat and prompt/completion data count their answers only (loss_mask)
    targets, weights = clm.next_token_targets(batch["input_ids"], batch["segment_ids"], batch.get("loss_mask"))
    blocks = logits_blocks(model.cfg, *targets.shape)
    # Each row's tokens weigh its mean (WEIGHT): the loss is the mean over the batch's tokens.
    tokens = jnp.sum(weights, axis=-1).astype(jnp.float32)
    if blocks is not None:
        loss, accuracy = blockwise_cross_entropy(
            hidden[:, :-1], model.output_kernel(), targets, weights, **_block_settings(model, *blocks)
        )
        return loss, {"token_accuracy": accuracy, WEIGHT: tokens}
    logits = constrain(model.logits(hidden), "batch", None, "vocab")  # (B, T, V) float32
    losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], targets)
    accuracy = masked_accuracy(logits[:, :-1], targets, weights)
    return masked_mean(losses, weights), {"token_accuracy": accuracy, WEIGHT: tokens}


def token_logps(model: LlamaForCausalLM, rows: dict[str, jax.Array], temperature: float = 1.0) -> jax.Array:
    """Each row's next tokens' log-probabilities ``[R, T - 1]`` under the logits divided by
    ``temperature`` (a :data:`~xlafit.train.losses.TokenLogps`): as the next-token loss, in
    blocks where :func:`logits_blocks` says so (``model.logits_chunk``), else from the whole
    logits. The preference objectives' and GRPO's, in training, evaluation, DPO's reference
    and the rollout's log-probability pass."""
    hidden = model.decode(rows["input_ids"], rows["segment_ids"], rows["positions"])
    targets, _ = clm.next_token_targets(rows["input_ids"], rows["segment_ids"])
    blocks = logits_blocks(model.cfg, *targets.shape)
    if blocks is not None:
        settings = _block_settings(model, *blocks)
        return blockwise_token_logps(
            hidden[:, :-1], model.output_kernel(), targets, temperature=temperature, **settings
        )
    logits = constrain(model.logits(hidden), "batch", None, "vocab")  # (R, T, V) float32
    return token_logps_of(logits[:, :-1], targets, temperature)


def _block_settings(model: LlamaForCausalLM, chunk: int, tile: int) -> dict[str, Any]:
    """The blockwise loss's settings for :func:`logits_blocks`'s ``(chunk, tile)``."""
    split = "vocab" if tile == model.cfg.vocab_size else None  # a tile of the vocabulary stays whole

    def layout(z: jax.Array) -> jax.Array:
        return constrain(z, "batch", None, split)

    cfg = model.cfg
    return {
        "chunk": chunk,
        "tile": tile,
        "softcap": cfg.final_logit_softcap,
        "dtype": cfg.compute_dtype,
        "layout": layout,
    }


# A device whose memory neither the hardware table nor JAX knows (a CPU) is taken to have a v5e chip's.
ASSUMED_MEMORY = 16 * 2**30


def logits_blocks(cfg: LlamaConfig, rows: int, seq_len: int) -> tuple[int, int] | None:
    """``(positions, vocabulary columns)`` of a block of the loss's logits for a batch of
    ``rows`` sequences of ``seq_len`` positions, or None for the whole logits at once.

    ``model.logits_chunk``: 0 is None; N positions a block; "auto" is None unless the whole
    float32 logits of one device's rows and their gradient
    (:func:`~xlafit.train.losses.whole_logits_bytes`, ``2 x rows x seq_len x vocab x 4``) would
    take more than 1/8 of its memory: the hardware table's HBM on a TPU
    (:func:`~xlafit.platform.hardware.table_memory`), what JAX reports on a GPU,
    :data:`ASSUMED_MEMORY` elsewhere. The blocks' sizes are
    :func:`~xlafit.train.losses.blocks_for`'s, over one device's rows (the batch over
    ``data`` x ``fsdp``) and vocabulary (the vocabulary whole where a tensor-parallel mesh
    splits it). Read while the step is traced, from its mesh.

    Example:
        >>> logits_blocks(LlamaConfig.preset("llama-3.1-8b"), rows=2, seq_len=8192)  # a CPU: 16 GiB assumed
        (2048, 16128)
        >>> logits_blocks(LlamaConfig.preset("tiny", vocab_size=2000), rows=8, seq_len=256) is None
        True
    """
    setting = cfg.logits_chunk
    if setting == 0:
        return None
    vocab, split = cfg.vocab_size, False
    layout = active_layout()
    device = jax.devices()[0] if layout is None else layout[0].devices.flat[0]
    if layout is not None:
        mesh, rules = layout
        sizes = dict(mesh.shape)
        rows //= math.prod(sizes[a] for a in batch_axes(mesh, rows) or ())
        axis = rules.get("vocab")
        if axis is not None and sizes.get(axis, 1) > 1 and vocab % sizes[axis] == 0:
            vocab, split = vocab // sizes[axis], True
    if setting == "auto" and whole_logits_bytes(rows, seq_len, vocab) <= device_memory(device) / 8:
        return None
    chunk, tile = blocks_for(rows, seq_len, vocab, None if setting == "auto" else setting)
    return chunk, cfg.vocab_size if split else tile


def device_memory(device: Any) -> float:
    """Bytes of memory of one device: the hardware table's for a TPU, JAX's for a GPU, else
    :data:`ASSUMED_MEMORY`."""
    found = table_memory(device.device_kind)
    if found is None and device.platform == "gpu":
        found = (device.memory_stats() or {}).get("bytes_limit")
    return float(found or ASSUMED_MEMORY)


def model_sizes(cfg: Config, vocab_size: int) -> LlamaConfig:
    """The model's sizes without building it: ``model.init_from_hf``'s ``config.json``, else
    the preset's with the config's overrides."""
    source = model_dir(cfg)
    if not source:
        return llama_config(cfg, vocab_size)
    return config_json.config_from_hf(read_json(Path(source).expanduser() / "config.json"))


def throughput(cfg: Config, train: clm.PackedText) -> Throughput:
    """Tokens (positions, padding included) and model FLOPs (PaLM's 6N + attention) per row."""
    llama = model_sizes(cfg, train.vocab_size)
    t = train.seq_len
    if cfg.model.objective == "grpo":  # an example is a completion: the train step's row (the rollout not counted)
        t += cfg.model.grpo.max_completion_length
        return {"tokens_per_example": float(t), "flops_per_example": t * llama.train_flops_per_token(t)}
    if llm_preference.objective_of(cfg) is not None:  # an example is a pair of rows; DPO may add the base's forward
        flops = 2 * t * llama.train_flops_per_token(t) * (1 + llm_preference.reference_passes(cfg) / 3)
        return {"tokens_per_example": 2.0 * t, "flops_per_example": flops}
    return {"tokens_per_example": float(t), "flops_per_example": t * llama.train_flops_per_token(t)}


RECIPE = Recipe(
    name="llm",
    model_config=LlmModelConfig,
    data_config=LlmDataConfig,
    load_data=load_data,
    eval_data=eval_data,
    from_data=from_data,
    build_model=build_model,
    loss_fn=loss_fn,
    loss_for=functools.partial(
        llm_grpo.loss_for,
        other=functools.partial(llm_preference.loss_for, next_token=loss_fn, token_logps=token_logps),
        token_logps=token_logps,
    ),
    throughput=throughput,
    shapes=shapes,
    save_artifacts=save_artifacts,
    kept_files={
        "tokenizer/tokenizer.json": "tokenizer (data.tokenizer, else model.init_from_hf's); the checkpoints learned "
        "the run's token ids",
        files.FINGERPRINT_FILE: "data files (the sha256 of each file it trains and evaluates on): a file of "
        "data.data_dir or data.eval_data_dir was changed since the run started, and its rows are other rows",
    },
    data_fingerprint=llm_data.data_fingerprint,
    validate=validate,
    rollout=functools.partial(llm_grpo.rollout_for, token_logps=token_logps),
    eval_unit=lambda cfg: "pairs" if cfg.model.objective in ("dpo", "simpo", "orpo") else "rows",
)
