"""Export: a run's checkpoint -> a Hugging Face directory.

A bert run becomes a ``BertForMaskedLM`` (tokenizer included), a resnet run a
``ResNetForImageClassification`` (running batch statistics included, its classes' names,
and the image processor of its evaluation transform), an llm run a ``LlamaForCausalLM``
(tokenizer included; a LoRA run's adapters merged into it, and written apart as a PEFT
adapter in ``adapter/``): ``config.json`` and ``model.safetensors`` that
``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import typing
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import yaml
from flax import nnx
from tokenizers import Tokenizer, processors

from xlafit.checkpoint import Checkpointer
from xlafit.checkpoint_read import read_checkpoint
from xlafit.config import Config
from xlafit.data import clm, rendering, special_tokens
from xlafit.errors import CheckpointError, ConfigError, StorageError
from xlafit.hf import config_json
from xlafit.hf import llama as llama_hf
from xlafit.hf.bert import save_hf
from xlafit.hf.peft import peft_misreads, save_peft_adapter
from xlafit.hf.resnet import image_processor_config
from xlafit.hf.resnet import save_hf as save_resnet_hf
from xlafit.io import hub
from xlafit.io.paths import (
    as_path,
    bucket_of,
    check_bucket,
    dated_sibling,
    describe_error,
    download_dir,
    is_url,
    move,
    reach,
    upload_dir,
)
from xlafit.io.paths import local as local_path
from xlafit.models.bert import BertForMaskedLM
from xlafit.models.llama import LlamaForCausalLM
from xlafit.models.lora import ADAPTER, base_fingerprint, merge_lora
from xlafit.models.resnet import ResNet
from xlafit.parallel.cluster import configure, start_backends
from xlafit.parallel.sharding import path_name
from xlafit.recipes import config_from_dict
from xlafit.recipes.bert import bert_config
from xlafit.recipes.llm import build_from_config, build_llama
from xlafit.recipes.llm_data import (
    DATA_FORMAT_FILE,
    GENERATION_CONFIG,
    base_config,
    base_generation,
    model_dir,
    recorded_model_dir,
)
from xlafit.recipes.resnet import CLASSES_FILE, augmentation, image_size, normalisation_for, resnet_config
from xlafit.run import with_lora
from xlafit.rundir import checkpoint_dir
from xlafit.saveable import older_layout
from xlafit.train.frozen import BASE_FINGERPRINT


class Exported(typing.NamedTuple):
    """What :func:`export_hf` wrote."""

    out: str
    step: int  # the checkpoint's
    files: list[str]  # the top-level names written in ``out`` ("adapter/": a folder)
    earlier: str | None  # where an earlier export in ``out`` was moved, None if there was none


def export_hf(run_dir: str | Path, out: str | Path, step: int | None = None) -> Exported:
    """Writes a run's model (checkpoint ``step``, default the newest intact one) as a Hugging
    Face directory: a bert run as ``BertForMaskedLM`` with its tokenizer, a resnet run as
    ``ResNetForImageClassification``, an llm run as ``LlamaForCausalLM`` with its tokenizer
    (LoRA: merged, and the adapter alone in ``out/adapter``, :func:`export_llm`).

    ``run_dir`` and ``out`` may be local paths or URLs (``gs://bucket/run``). The export is
    written to a scratch folder first and moved (a URL: uploaded file by file) into ``out``
    whole, so no file of another export is left beside it: an earlier xlafit export in
    ``out`` is moved aside to ``<out>-before-export-<time>``; ``out`` holding anything else,
    or lying inside the run directory, is refused before any work.

    Example:
        >>> export_hf("runs/bert", "hf/")  # doctest: +SKIP
    """
    run, target = as_path(run_dir), as_path(out)
    _check_out(run, target)
    reach(run)
    try:
        found, there = (run / "config.yaml").exists(), run.exists()
    except Exception as e:
        raise ConfigError(f"cannot read {run}: {describe_error(run, e)}") from None
    if not there:
        raise ConfigError(f"{run}: no such run directory; give the directory a run trained in (its --run-dir).")
    if not found:
        raise ConfigError(f"{run} is not a run directory (no config.yaml).")
    config_text = (run / "config.yaml").read_text()
    saved = yaml.safe_load(config_text)
    recipe = saved.get("recipe")
    if recipe not in ("bert", "resnet", "llm"):
        raise ConfigError(f"{run} is a {recipe!r} run; only bert, resnet and llm runs export to Hugging Face.")
    if recipe in ("bert", "llm") and not (run / "tokenizer" / "tokenizer.json").exists():
        raise ConfigError(f"{run} has no tokenizer/ (written when training starts); cannot export.")
    cfg = config_from_dict(recipe, {k: v for k, v in saved.items() if k != "recipe"})
    cfg.run.run_dir = str(run)  # where the run is now: it may have moved since it trained
    if recipe == "llm":
        recorded_model_dir(cfg, run)  # the base it started from, found before anything starts
    # The run's XLA:CPU settings before JAX starts: a new model's LoRA base is re-initialised
    # here, and its rounding (so its fingerprint) depends on them.
    configure(cpu=cfg.cpu)
    start_backends()
    arrays, step, metadata = checkpoint_arrays(cfg, run, step)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "out"
        # where the export ends up: a new model's adapter names its base there, not in this temporary folder
        final = os.fspath(out).rstrip("/") if is_url(out) else os.path.abspath(local_path(out))
        _write(recipe, cfg, run, arrays, metadata, local, Path(tmp), final)
        (local / EXPORT_MARK).write_text(config_text)
        files = sorted(p.name + ("/" if p.is_dir() else "") for p in local.iterdir())
        if is_url(out) and bucket_of(out):
            try:
                check_bucket(out, "--out")
            except StorageError as e:
                raise ConfigError(str(e)) from None
        earlier = None
        if _holds_files(target):  # an earlier export (_check_out refused anything else)
            earlier = dated_sibling(target, "before-export")
            move(target, earlier)
        try:
            if is_url(out):
                upload_dir(local, target)
            else:
                folder = Path(local_path(out))
                if folder.is_dir():
                    folder.rmdir()  # empty (one with files went aside): else the move would nest in it
                folder.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(local, folder)
        except Exception as e:
            raise ConfigError(f"cannot write the export: {describe_error(out, e)}") from None
    return Exported(str(out), step, files, str(earlier) if earlier is not None else None)


# The file every export writes (the run's config): a folder holding it is an earlier export.
EXPORT_MARK = "xlafit-config.yaml"


def _holds_files(path: Any) -> bool:
    try:
        return bool(path.is_dir() and any(path.iterdir()))
    except Exception as e:
        raise ConfigError(f"cannot read --out {path}: {describe_error(path, e)}") from None


def _check_out(run: Any, out: Any) -> None:
    """Refuses an ``--out`` the export would mix with other files, before any work."""
    inside = os.path.abspath(os.fspath(out)) if not is_url(out) else os.fspath(out).rstrip("/")
    home = os.path.abspath(os.fspath(run)) if not is_url(run) else os.fspath(run).rstrip("/")
    if inside == home or inside.startswith(home + "/"):
        raise ConfigError(f"--out {out} is inside the run directory {run}; give a folder outside it.")
    try:
        is_file = out.is_file()
    except Exception as e:
        raise ConfigError(f"cannot read --out {out}: {describe_error(out, e)}") from None
    if is_file:
        raise ConfigError(f"--out {out} is a file; give a directory to write the export to (a new one, or a folder).")
    if _holds_files(out) and not (out / EXPORT_MARK).exists():
        raise ConfigError(
            f"--out {out} holds files that are not an xlafit export (no {EXPORT_MARK}); give a new or empty folder, "
            "so that no other file ends up beside the model."
        )


def _write(
    recipe: str, cfg: Config, run: Any, arrays: Any, metadata: dict[str, str], local: Path, tmp: Path, final: str
) -> None:
    """Writes the model of one recipe's checkpoint (``arrays``) to ``local``, which is then moved
    to ``final``."""
    if recipe == "bert":
        vocab = json.loads((run / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
        model = BertForMaskedLM(bert_config(cfg, len(vocab)), rngs=nnx.Rngs(0))
        _fill(model, nnx.Param, arrays["params"])
        tok_dir = download_dir(run / "tokenizer", tmp / "tokenizer")  # the run's may be on gs://
        save_hf(model, local, tokenizer_dir=tok_dir)
    elif recipe == "llm":
        tokenizer_json = (run / "tokenizer" / "tokenizer.json").read_text()
        template = run / "tokenizer" / rendering.TEMPLATE_FILE
        chat_template = template.read_text() if template.exists() else None
        tokens_file = run / "tokenizer" / "tokenizer_config.json"
        tokens = json.loads(tokens_file.read_text()) if tokens_file.exists() else {}
        ends = (
            run / "tokenizer" / GENERATION_CONFIG
        )  # end tokens the run kept beside its tokenizer (stop_ids reads them)
        if ends.exists():
            local.mkdir(parents=True, exist_ok=True)
            (local / GENERATION_CONFIG).write_text(ends.read_text())
        fingerprint = metadata.get(BASE_FINGERPRINT)
        export_llm(cfg, arrays, fingerprint, tokenizer_json, local, chat_template, tokens, f"{final}/base", run)
        if (run / DATA_FORMAT_FILE).exists():  # `xlafit generate` asks the export as the run trained
            (local / DATA_FORMAT_FILE).write_text((run / DATA_FORMAT_FILE).read_text())
    else:
        net = _resnet(cfg, arrays)
        channels = net.cfg.num_channels
        save_resnet_hf(net, local, labels=_classes(run), processor=_image_processor(cfg, channels))
        if channels == 1:  # transformers' image processors give every image three channels
            mean, std = normalisation_for(cfg, 1)
            print(
                "the model takes single-channel (greyscale) images, and transformers' image processors and pipeline "
                "give it three channels: convert each image to one first (PIL's image.convert('L'); pixels / 255, "
                f"then (x - {mean[0]:.4f}) / {std[0]:.4f}) and call the model with pixel_values of shape "
                "[batch, 1, height, width]",
                flush=True,
            )


# How long export and generate wait for a run's first checkpoint that is being committed.
COMMIT_WAIT_S = 60.0


def _first_save_underway(directory: Any) -> bool:
    """Whether a local checkpoint directory holds a save being written or committed (a step's
    folder, or Orbax's temporary one) that is not yet listed as a checkpoint."""
    if is_url(directory) or not Path(local_path(directory)).is_dir():
        return False
    return any(p.name.split(".", 1)[0].isdigit() for p in Path(local_path(directory)).iterdir())


def checkpoint_arrays(cfg: Config, run: Any, step: int | None, use: str = "export") -> tuple[Any, int, dict[str, str]]:
    """The saved state of checkpoint ``step`` (default: the newest intact one) as host arrays,
    with the metadata it was saved with; ``use`` (export or generate) words the error of a run
    with no checkpoint. A run whose first save is being committed is waited for (up to
    :data:`COMMIT_WAIT_S`), as when a notebook asks a model that has just started training. A
    newer checkpoint passed over (corrupt, unreadable) is said once, on stderr, with the one
    used.

    Raises:
        CheckpointError: no checkpoint; ``step`` absent, corrupt or unreadable; or none that
            reads (:func:`~xlafit.checkpoint_read.read_checkpoint`).
    """
    directory = checkpoint_dir(cfg)
    ckpt = Checkpointer(directory)  # the run may be training meanwhile
    try:
        infos = ckpt.list()
        waited = 0.0
        while step is None and not infos and waited < COMMIT_WAIT_S and _first_save_underway(directory):
            time.sleep(0.5)  # the run's first checkpoint is being committed: read it once it is
            waited += 0.5
            ckpt.close()
            ckpt = Checkpointer(directory)
            infos = ckpt.list()
        if step is None and not infos:
            generating = use == "generate"
            purpose = "generate with" if generating else "export"
            other = ", or give a Hugging Face model directory" if generating else ""
            raise CheckpointError(f"{run} has no intact checkpoint to {purpose}; train it until it saves one{other}.")
        read = read_checkpoint(ckpt, step, infos)
        if read.passed_over:
            print(f"warning: {read.passed()}; using checkpoint {read.step}", file=sys.stderr, flush=True)
        return read.arrays, read.step, read.metadata  # the same save's: a rotation may remove it now
    finally:
        ckpt.close()


def run_model(cfg: Config, arrays: Any, fingerprint: str | None, vocab_size: int, run: Any) -> LlamaForCausalLM:
    """An llm run's model with a checkpoint's weights (``arrays``): a LoRA run's base rebuilt
    as the run built it (``model.init_from_hf``, or the same initialisation, which must have
    the fingerprint the checkpoint recorded) with the adapters, unmerged; a full fine-tune of
    ``model.init_from_hf`` made from its ``config.json`` alone (the base's, or the copy the
    ``run`` keeps), every weight the checkpoint's.

    Raises:
        CheckpointError: the rebuilt base is not the one the adapters were trained on.
    """
    build = lambda: with_lora(build_llama(cfg, vocab_size), cfg.lora, cfg.trainer.seed)  # noqa: E731
    if cfg.model.init_from_hf and not cfg.lora.rank:  # no weight of the base is read
        config = base_config(cfg, run)
        build = lambda: build_from_config(cfg, config)  # noqa: E731
    if cfg.model.init_from_hf and cfg.lora.rank:
        model = build()
    else:  # inside jit, as the trainer built it: eager initialisation rounds differently
        abstract = nnx.eval_shape(build)
        model = nnx.merge(nnx.graphdef(abstract), jax.jit(lambda: nnx.state(build()))())
    _fill(model, ADAPTER if cfg.lora.rank else nnx.Param, arrays["params"])
    assert isinstance(model, LlamaForCausalLM)
    if cfg.lora.rank and fingerprint != base_fingerprint(model):
        rebuilt = base_fingerprint(model)[:12]
        if cfg.model.init_from_hf:
            fix = "put the run's model.init_from_hf back as it was"
        else:  # a new model's random base: its rounding depends on the platform and the cpu.* settings
            fix = "a new model's base is re-initialised from the run's config; do this on the platform it trained on"
        raise CheckpointError(
            f"the base model rebuilt from the run's config (fingerprint {rebuilt}...) is not the one its adapters "
            f"were trained on ({(fingerprint or 'none')[:12]}...); {fix}."
        )
    return model


def export_llm(
    cfg: Config,
    arrays: Any,
    fingerprint: str | None,
    tokenizer_json: str,
    out: Path,
    chat_template: str | None = None,
    tokens: dict[str, str] | None = None,
    base_at: str | None = None,
    run: Any = None,
) -> None:
    """Writes an llm run's model to ``out`` as a ``LlamaForCausalLM`` with its tokenizer (and
    the chat template it trained with, in ``tokenizer_config.json`` and ``chat_template.jinja``;
    ``tokens``: the special tokens the run's tokenizer named, a chat model's end of turn as
    its ``eos_token``).

    ``config.json`` names the tokenizer's ``bos_token_id`` and ``pad_token_id``, and
    ``config.json`` and ``generation_config.json`` every token that ends an answer as
    ``eos_token_id`` (the end of document and a chat template's end of turn,
    :func:`xlafit.data.clm.stop_ids`; one id where there is one), so that
    ``transformers``' ``generate`` stops where ``xlafit generate`` does. A run initialised from
    a checkpoint with a ``generation_config.json`` (``model.init_from_hf``) keeps its settings
    (sampling, its end tokens where the run kept its tokenizer).

    A LoRA run's checkpoint holds the adapters only: the base is rebuilt as the run built it
    (``model.init_from_hf``, or the same initialisation) and must have the fingerprint the
    checkpoint recorded. The adapter goes to ``out/adapter`` (PEFT's format, its base
    ``model.init_from_hf``; with no such directory the base itself goes to ``out/base``)
    and ``out`` holds the merged weights; ``base_at``: where ``out/base`` ends up, for the
    adapter to name (default: ``out/base`` itself).

    Raises:
        CheckpointError: the rebuilt base is not the one the adapters were trained on.
    """
    out.mkdir(parents=True, exist_ok=True)
    # the generation settings the run recorded when it started (its base's then), over the base's now
    snapshot = out / GENERATION_CONFIG
    recorded = json.loads(snapshot.read_text()) if snapshot.exists() else {}
    token_ids, generation = _write_tokenizer(cfg, tokenizer_json, out, chat_template, tokens, recorded)
    # The model's vocabulary is the tokenizer's, tokens added after training (a chat model's) included.
    model = run_model(cfg, arrays, fingerprint, Tokenizer.from_str(tokenizer_json).get_vocab_size(), run)
    # A quantized base is merged as PEFT merges into a bitsandbytes base: into its dequantized
    # weights, written in bfloat16 (merge_lora); a bfloat16 base as PEFT merges into a model
    # loaded in bfloat16: written in bfloat16, its own precision.
    low = bool(cfg.lora.rank) and cfg.lora.base_dtype != "float32"
    dtype: typing.Literal["float32", "bfloat16"] = "bfloat16" if low else "float32"
    if cfg.lora.rank:
        if not cfg.model.init_from_hf:
            base = nnx.clone(model)  # a copy with its own variables: zeroing its adapters leaves the model's
            without = typing.cast(LlamaForCausalLM, merge_lora(_without_adapters(base)))
            llama_hf.save_hf(without, out / "base", token_ids=token_ids, dtype=dtype)
            _write_tokenizer(cfg, tokenizer_json, out / "base", chat_template, tokens, recorded)  # a model folder
            (out / "base" / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        if cfg.model.init_from_hf:
            base_path = cfg.model.init_from_hf
            if not hub.is_hub_id(base_path):  # a hub id stays one: PEFT reads it from the hub's cache
                base_path = str(Path(base_path).expanduser().absolute())
        else:  # where the export puts its base (an absolute path, or a bucket's URL as it is)
            base_path = base_at or str((out / "base").absolute())
        folder = model_dir(cfg)  # the base as the run read it (a hub id: its snapshot in the cache)
        multimodal = folder is not None and config_json.is_multimodal(folder)
        loads, whole = config_json.causal_lm_class(folder) if folder is not None and multimodal else ("", False)
        save_peft_adapter(model, out / "adapter", base_model_name_or_path=base_path, multimodal=whole)
        # its tokenizer beside it, as TRL saves an adapter: AutoTokenizer reads the adapter's folder too
        _write_tokenizer(cfg, tokenizer_json, out / "adapter", chat_template, tokens, recorded)
        if multimodal:
            print(
                f"the base is a multimodal checkpoint: the merged model is its text model alone, without the vision "
                f"tower; adapter/ names the modules of what AutoModelForCausalLM loads for the base ({loads}), and "
                "applies to the whole model there"
                + ("" if whole else " only as that text model (AutoModelForImageTextToText names them otherwise)"),
                flush=True,
            )
        misread = peft_misreads(model)
        if misread:
            print(
                f"warning: adapter/ adapts a dense layer's MLP ({', '.join(misread[:3])}"
                f"{', ...' if len(misread) > 3 else ''}), which PEFT reads on a {model.cfg.family} model as its "
                "experts' (its conversion of transformers 4's MoE layout): transformers + peft load it without those "
                "adapters, or not at all where the experts are adapted too. The merged model here holds them all; "
                "for an adapter that PEFT applies whole, leave gate_proj, up_proj and down_proj out of lora.targets.",
                flush=True,
            )
        model = typing.cast(LlamaForCausalLM, merge_lora(model))
        if cfg.lora.base_dtype == "bfloat16":
            print(
                "the adapters trained on a bfloat16 base (lora.base_dtype): the merged model is written in bfloat16, "
                "as PEFT merges into a base loaded in bfloat16",
                flush=True,
            )
        if cfg.lora.quantized:
            print(
                f"the adapters trained on an {cfg.lora.base_dtype} base (lora.base_dtype): the merged model is its "
                "dequantized weights plus the adapters' update, in bfloat16, as PEFT merges into a bitsandbytes "
                "base; adapter/ applies to the unquantized base model",
                flush=True,
            )
    llama_hf.save_hf(model, out, token_ids=token_ids, dtype=dtype)
    (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")


def _write_tokenizer(
    cfg: Config,
    tokenizer_json: str,
    out: Path,
    chat_template: str | None,
    tokens: dict[str, str] | None,
    recorded: dict[str, Any] | None = None,
) -> tuple[dict[str, int | list[int] | None], dict[str, Any]]:
    """Writes the tokenizer's files to ``out``; returns the ids of its special tokens (for
    ``config.json``: every end token's as ``eos_token_id``) and ``generation_config.json``'s
    settings: ``recorded`` (the run's, from when it started) over its base's."""
    tok = Tokenizer.from_str(tokenizer_json)
    given = tokens or {}
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    bos, eos = special_tokens.markers(tok, given or None)  # what the run trained with
    for key, found in (("bos_token", bos), ("eos_token", eos), ("pad_token", tok.token_to_id(clm.PAD))):
        name = special_tokens.token_name(given.get(key)) or (tok.id_to_token(found) if found is not None else None)
        if name is not None:
            config[key] = name
    written = tokenizer_json
    if bos is not None and special_tokens.first_added(tok) != bos:  # an older xlafit's: transformers adds <s> too
        name = tok.id_to_token(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{name} $A", pair=f"{name} $A {name}:1 $B:1", special_tokens=[(name, bos)]
        )
        written = tok.to_str(pretty=True)
    (out / "tokenizer.json").write_text(written)
    if chat_template:
        config["chat_template"] = chat_template
        (out / rendering.TEMPLATE_FILE).write_text(chat_template)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids: dict[str, int | list[int] | None] = {
        f"{key}_id": tok.token_to_id(config[key]) if key in config else None
        for key in ("bos_token", "eos_token", "pad_token")
    }
    generation = {**base_generation(cfg, tokenizer_json), **(recorded or {})}
    ends = set(clm.stop_ids(out))
    theirs = generation.get("eos_token_id")
    ends.update(theirs if isinstance(theirs, list) else [] if theirs is None else [theirs])
    generation.update({key: value for key, value in ids.items() if value is not None})
    if ends:
        generation["eos_token_id"] = sorted(ends) if len(ends) > 1 else next(iter(ends))
        # config.json lists every end token too, as the families' own configs do (Llama 3.1
        # Instruct's three, Gemma 3's two): tools that read the model's config stop there as well.
        ids["eos_token_id"] = generation["eos_token_id"]
    return ids, generation


def _without_adapters(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """``model`` with every adapter zeroed (merging then gives the base weights back)."""
    nnx.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, ADAPTER)))
    return model


def _fill(model: nnx.Module, kind: Any, saved: Any, prefix: str = "") -> None:
    """Sets ``model``'s variables of ``kind`` from a saved tree (``prefix``: the model's path in it)."""
    raw = {path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(saved)[0]}
    state = nnx.state(model, kind)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    try:
        values = [_value(raw[prefix + path_name(p)], prefix + path_name(p), x) for p, x in leaves]
    except KeyError as e:
        raise CheckpointError(f"the checkpoint has no {e.args[0]}; was it written by another model?") from None
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, values))


def _value(saved: Any, path: str, like: Any) -> jax.Array:
    """A saved array in ``like``'s shape: converted when saved in an older layout (``RESHAPED``)."""
    value = jnp.asarray(saved)
    older = older_layout(path, value.shape, tuple(like.shape))
    if older is not None:
        return older(value)
    if value.shape != tuple(like.shape):
        raise CheckpointError(
            f"the checkpoint's {path} is {value.shape}, and the model the run's config.yaml and files describe has "
            f"{tuple(like.shape)}: they were changed after the checkpoint was written. Restore the run's config.yaml "
            "(and tokenizer/) to what trained it."
        )
    return value


def _classes(run: Any) -> list[str] | None:
    """The class names a resnet run recorded (``classes.json``); None for synthetic data or a
    run from before they were recorded (the export then names them LABEL_0, LABEL_1, ...)."""
    names = run / CLASSES_FILE
    return json.loads(names.read_text()) if names.exists() else None


def _image_processor(cfg: Config, channels: int) -> dict[str, Any]:
    """The evaluation transform of a resnet run, as Hugging Face's image processor config,
    normalised per channel as the model's input (:func:`~xlafit.recipes.resnet.normalisation_for`)."""
    mean, std = normalisation_for(cfg, channels)
    return image_processor_config(image_size(cfg), augmentation(cfg)[2], mean, std)


def _resnet(cfg: Config, arrays: Any) -> ResNet:
    """The ResNet of a resnet run's checkpoint, running statistics included (eval mode).

    The recipe's model holds the network as ``net`` (behind its input normalisation); the
    input channels and classes are read off the stem and the classifier.
    """
    params = {path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(arrays["params"])[0]}
    prefix = "net/" if any(k.startswith("net/stem/") for k in params) else ""
    stem = next(v for k, v in params.items() if k.startswith(f"{prefix}stem/conv/kernel"))
    head = next(v for k, v in params.items() if k.startswith(f"{prefix}head/kernel"))
    net_cfg = resnet_config(cfg, num_classes=int(head.shape[1]), channels=int(stem.shape[2]))
    model = nnx.eval_shape(lambda: ResNet(config=net_cfg, rngs=nnx.Rngs(0)))
    _fill(model, nnx.Param, arrays["params"], prefix)
    _fill(model, nnx.BatchStat, arrays["model_state"], prefix)
    return model
