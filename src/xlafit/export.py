"""Export: a bert run's checkpoint -> a Hugging Face ``BertForMaskedLM`` directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import yaml
from flax import nnx

from xlafit.checkpoint import Checkpointer, CheckpointError, path_name
from xlafit.config import ConfigError
from xlafit.models.bert import BertForMaskedLM
from xlafit.models.bert_hf import save_hf
from xlafit.recipes import config_from_dict
from xlafit.recipes.bert import bert_config
from xlafit.run import checkpoint_dir


def export_hf(run_dir: str | Path, out: str | Path, step: int | None = None) -> tuple[Path, int]:
    """Writes a run's parameters (checkpoint ``step``, default the newest intact one) as a
    Hugging Face ``BertForMaskedLM`` directory, tokenizer included. Returns (out, step).

    Example:
        >>> export_hf("runs/bert", "hf/")  # doctest: +SKIP
    """
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
    out = save_hf(model, out, tokenizer_dir=tok_dir)
    shutil.copy2(run / "config.yaml", out / "xlafit-config.yaml")
    return out, step
