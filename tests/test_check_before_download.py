"""``xlafit check --tpu`` of a Hugging Face model before its weights are downloaded: the model
is made from ``config.json`` (a hub id fetches its configuration and tokenizer alone), with the
same shapes and types as the model read from its weights."""

from __future__ import annotations

import json

import jax
import pytest
from flax import nnx

from tests.helpers import xlafit_cli
from tests.hub_server import HubServer
from tests.test_hub import lay_out_cache
from xlafit.check import recipe_program
from xlafit.data import clm
from xlafit.hf import llama as llama_hf
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.recipes import llm, load_config
from xlafit.run import with_lora


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Llama with its tokenizer: whole (weights and all), and its ``config.json`` and
    tokenizer alone, as ``hf download org/name config.json tokenizer.json`` leaves them."""
    work = tmp_path_factory.mktemp("before-download")
    (work / "text.txt").write_text("\n\n".join(f"document {i}: the quick brown fox jumps" for i in range(40)))
    tok = clm.train_bpe([str(work / "text.txt")], 200, work / "whole")
    config = LlamaConfig(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
        vocab_size=tok.get_vocab_size(), max_position_embeddings=256, tie_embeddings=False,
    )  # fmt: skip
    llama_hf.save_hf(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), work / "whole")
    shapes_only = work / "config-only"
    shapes_only.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (shapes_only / name).write_bytes((work / "whole" / name).read_bytes())
    assert not list(shapes_only.glob("*.safetensors*"))
    return work


def _abstract(model):
    return jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(model), is_leaf=lambda x: hasattr(x, "shape"))


@pytest.mark.parametrize("base", ["bfloat16", "nf4"])
def test_a_config_alone_compiles_the_model_its_weights_would_make(checkpoints, base):
    """The check's model from ``config.json`` alone has every variable of the model read from
    the weights (a 4-bit base's codes and scales included), of the same shape and type."""
    settings = ["lora.rank=4", f"lora.base_dtype={base}", "data.seq_len=64", "data.global_batch=8"]
    read = load_config("llm", [f"model.init_from_hf={checkpoints / 'whole'}", *settings])
    weights = nnx.eval_shape(lambda: with_lora(llm.build_llama(read, 200), read.lora, 0))
    program, cfg, _ = recipe_program("llm", [f"model.init_from_hf={checkpoints / 'config-only'}", *settings])
    assert cfg.model.init_from_hf.endswith("config-only")
    assert _abstract(program.model) == _abstract(weights)


def test_check_tpu_of_a_hub_model_reads_its_config_and_tokenizer_alone(checkpoints, tmp_path):
    """A hub id whose cache holds config.json and tokenizer.json (no weights): `check --tpu`
    compiles it; a training run of it says the weights are missing."""
    home = tmp_path / "hf-home"
    files = {name: checkpoints / "config-only" / name for name in ("config.json", "tokenizer.json")}
    lay_out_cache(home, "tiny-org/tiny-llama", files)
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "XLAFIT_CACHE": str(tmp_path / "cache")}
    settings = ["model.init_from_hf=tiny-org/tiny-llama", "lora.rank=4", "data.seq_len=64", "data.global_batch=8"]
    data = f"data.data_dir={checkpoints / 'text.txt'}"
    check = xlafit_cli("check", "llm", "--tpu", "v4-8", data, *settings, env=env)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    assert "train step fits" in check.stdout
    train = xlafit_cli("train", "llm", "--run-dir", str(tmp_path / "run"), data, *settings, env=env)
    assert train.returncode == 2, train.stdout[-3000:] + train.stderr[-3000:]
    assert "has neither model.safetensors nor model.safetensors.index.json" in train.stderr
    assert "Traceback" not in train.stderr and not (tmp_path / "run").exists()


def test_check_tpu_downloads_no_weights_and_a_run_then_downloads_them(checkpoints, tmp_path):
    """Against a hub on 127.0.0.1 (:class:`tests.hub_server.HubServer`, read by
    huggingface_hub's own client): `check --tpu` of a hub id fetches its config.json and
    tokenizer, not model.safetensors; the run after it fetches the weights and trains."""
    server = HubServer("tiny-org/tiny-llama", checkpoints / "whole")
    try:
        env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0",
               "XLAFIT_CACHE": str(tmp_path / "cache")}  # fmt: skip
        settings = ["model.init_from_hf=tiny-org/tiny-llama", "lora.rank=4", "data.seq_len=64", "data.global_batch=8"]
        data = f"data.data_dir={checkpoints / 'text.txt'}"
        check = xlafit_cli("check", "llm", "--tpu", "v4-8", data, *settings, env=env)
        assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
        assert "train step fits" in check.stdout
        assert "config.json" in server.requested and "tokenizer.json" in server.requested
        assert not [f for f in server.requested if f.endswith(".safetensors")], server.requested
        run = ["--run-dir", str(tmp_path / "run"), "trainer.stop_at_step=1", "trainer.eval_every_epochs=100"]
        train = xlafit_cli("train", "llm", *run, data, *settings, env=env)
        assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
        assert "model.safetensors" in server.requested
    finally:
        server.close()


def test_a_checkpoints_check_on_the_demo_corpus_reads_no_corpus(checkpoints):
    """A check of a checkpoint on the default data read the Korean demo corpus (the konlpy
    wheel, which a user checking a hub model need not have) to learn shapes that one
    placeholder row of the config's vocabulary gives, as for a preset."""
    program, _, examples = recipe_program("llm", [f"model.init_from_hf={checkpoints / 'config-only'}", "lora.rank=4"])
    assert examples is None  # no data read: a placeholder row
    config = json.loads((checkpoints / "config-only" / "config.json").read_text())
    assert program.model.cfg.vocab_size == config["vocab_size"]
