"""Export: a bert run's checkpoint -> a Hugging Face ``BertForMaskedLM`` directory."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import jax
import yaml
from flax import nnx

from xlafit.checkpoint import Checkpointer, CheckpointError, path_name
from xlafit.config import ConfigError
from xlafit.models.bert import BertForMaskedLM
from xlafit.models.bert_hf import save_hf
from xlafit.paths import (
    StorageError,
    as_path,
    bucket_of,
    check_bucket,
    describe_error,
    download_dir,
    is_url,
    upload_dir,
)
from xlafit.recipes import config_from_dict
from xlafit.recipes.bert import bert_config
from xlafit.run import checkpoint_dir


def export_hf(run_dir: str | Path, out: str | Path, step: int | None = None) -> tuple[str, int]:
    """Writes a run's parameters (checkpoint ``step``, default the newest intact one) as a
    Hugging Face ``BertForMaskedLM`` directory, tokenizer included. Returns (out, step).

    ``run_dir`` and ``out`` may be local paths or URLs (``gs://bucket/run``): a URL output
    is written locally first and uploaded file by file.

    Example:
        >>> export_hf("runs/bert", "hf/")  # doctest: +SKIP
    """
    run = as_path(run_dir)
    try:
        found = (run / "config.yaml").exists()
    except Exception as e:
        raise ConfigError(f"cannot read {run}: {describe_error(run, e)}") from None
    if not found:
        raise ConfigError(f"{run} is not a run directory (no config.yaml).")
    config_text = (run / "config.yaml").read_text()
    saved = yaml.safe_load(config_text)
    if saved.get("recipe") != "bert":
        raise ConfigError(f"{run} is a {saved.get('recipe')!r} run; only bert runs export to Hugging Face.")
    if not (run / "tokenizer" / "tokenizer.json").exists():
        raise ConfigError(f"{run} has no tokenizer/ (written when training starts); cannot export.")
    cfg = config_from_dict("bert", {k: v for k, v in saved.items() if k != "recipe"})
    vocab = json.loads((run / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    model = BertForMaskedLM(bert_config(cfg, len(vocab)), rngs=nnx.Rngs(0))
    cfg.run.run_dir = str(run)  # where the run is now: it may have moved since it trained
    ckpt = Checkpointer(checkpoint_dir(cfg))
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
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = download_dir(run / "tokenizer", Path(tmp) / "tokenizer")  # the run's may be on gs://
        local = Path(tmp) / "out" if is_url(out) else Path(out)
        save_hf(model, local, tokenizer_dir=tok_dir)
        (local / "xlafit-config.yaml").write_text(config_text)
        if is_url(out):
            if bucket_of(out):
                try:
                    check_bucket(out, "--out")
                except StorageError as e:
                    raise ConfigError(str(e)) from None
            try:
                upload_dir(local, as_path(out))
            except Exception as e:
                raise ConfigError(f"cannot write the export: {describe_error(out, e)}") from None
    return str(out), step
