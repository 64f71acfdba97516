"""Gemma 4's mixture of experts (``gemma4_text`` with ``enable_moe_block``: the 26B-A4B's
layout): a random tiny checkpoint, every dense feature of test_gemma4's on too, loads with
transformers' logits (float32, 1e-4) and router probabilities whichever way the experts are
computed, scans its repeating block, generates what ``transformers.generate`` does, exports
the fused expert tensors transformers reads back, fine-tunes with the llm recipe from its
export, and takes LoRA on attention, the dense MLP and the experts as a PEFT adapter."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import xlafit
from helpers import peft_tuned
from test_gemma4 import IDS, gemma4_config
from xlafit.data import clm
from xlafit.errors import ConfigError, HFFormatError
from xlafit.hf import config_json
from xlafit.hf import llama as llama_hf
from xlafit.hf.files import open_safetensors
from xlafit.models.generation import generate
from xlafit.models.lora import apply_lora
from xlafit.recipes import load_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
KINDS = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def _random(config):
    """A transformers Gemma4ForCausalLM with random weights: norms, router scales and layer
    scalars off their initial values too."""
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if "inv_freq" not in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = _random(gemma4_config(**MOE))
    folder = tmp_path_factory.mktemp("gemma4-moe")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@nnx.jit
def _ours(model, *args):
    """The model's logits, compiled (op by op, the grouped products' sorts and gathers are slow)."""
    return model(*args)


def _theirs(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def _names(folder):
    with open_safetensors(folder / "model.safetensors") as f:
        return set(f.keys())  # noqa: SIM118 (safe_open is no dict)


def test_the_config_reads_the_experts_and_writes_them_back(checkpoint):
    _, folder = checkpoint
    assert "model.layers.0.experts.gate_up_proj" in _names(folder)  # transformers' fused layout, read as it is
    cfg = llama_hf.read_config(folder)[1]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_size, cfg.norm_topk_prob) == (4, 2, 16, True)
    assert cfg.moe_beside_mlp and cfg.moe_layers == (True,) * 6 and cfg.router_aux_loss_coef == 0.0
    written = config_json.hf_config(cfg)
    assert {key: written[key] for key in MOE} == MOE
    # FLOPs: each layer's dense MLP beside its router and k experts (6 per weight, forward and backward).
    dense = dataclasses.replace(cfg, num_experts=0).train_flops_per_token(16)
    assert cfg.train_flops_per_token(16) - dense == 6 * 6 * (64 * 4 + 3 * 64 * 16 * 2)


def test_a_mixture_of_experts_without_its_sizes_is_refused():
    config = gemma4_config(**MOE).to_dict()
    del config["top_k_experts"]
    with pytest.raises(HFFormatError, match="enable_moe_block=true and lacks top_k_experts"):
        config_json.config_from_hf(config)


@pytest.mark.parametrize("impl", ["ragged", "dense"])
def test_a_checkpoint_loads_with_transformers_logits(checkpoint, impl):
    theirs, folder = checkpoint
    ours = llama_hf.from_hf(folder, moe_impl=impl)
    np.testing.assert_allclose(np.asarray(_ours(ours, jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)


def test_the_router_probabilities_are_transformers(checkpoint):
    """Summed over the real tokens and the layers: the router's norm, scale and projection
    as transformers' (its router_logits are Gemma4TextRouter's probabilities)."""
    theirs, folder = checkpoint
    segments = np.ones((2, 16), np.int32)
    segments[1, 11:] = 0  # right padding, left out of the statistics
    with torch.no_grad():
        out = theirs(torch.tensor(IDS), attention_mask=torch.tensor(segments), output_router_logits=True)
    real = torch.tensor(segments).reshape(-1, 1).float()
    expected = sum((probs * real).sum(0) for probs in out.router_logits).numpy()
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    routed = nnx.jit(lambda m: m.decode_routed(jnp.array(IDS), jnp.array(segments), positions)[1])
    stats = routed(llama_hf.from_hf(folder))
    assert float(stats.layers) == 6 and float(jnp.sum(stats.expert_load())) == 2 * 27  # k x real tokens
    np.testing.assert_allclose(np.asarray(stats.probs), expected, rtol=1e-5)


def test_an_export_writes_the_fused_experts_transformers_reads(checkpoint, tmp_path):
    theirs, folder = checkpoint
    llama_hf.save_hf(llama_hf.from_hf(folder), tmp_path)
    assert _names(tmp_path) == _names(folder)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    np.testing.assert_allclose(_theirs(back.eval(), IDS), _theirs(theirs, IDS), atol=1e-5, rtol=1e-5)


def test_generation_with_the_cache_equals_transformers(checkpoint):
    theirs, folder = checkpoint
    ours = llama_hf.from_hf(folder)
    prompts = [IDS[0][:6], IDS[1][:3]]
    for prompt, tokens in zip(prompts, generate(ours, prompts, 7), strict=True):
        with torch.no_grad():
            out = theirs.generate(torch.tensor([prompt]), max_new_tokens=7, do_sample=False, eos_token_id=None)
        assert tokens == out[0, len(prompt) :].tolist()


def test_the_repeating_block_scans_to_transformers_logits(tmp_path):
    """No key/value sharing (the 26B-A4B's layout): two blocks of (sliding, sliding, global),
    each layer with its experts; transformers' logits, and an export of the stacked experts
    that transformers reads back."""
    theirs = _random(gemma4_config(**MOE, num_kv_shared_layers=0, use_double_wide_mlp=False))
    theirs.save_pretrained(tmp_path / "hf", safe_serialization=True)
    scanned = llama_hf.from_hf(tmp_path / "hf", scan_layers=True)
    assert scanned.cfg.scan_period == 3
    np.testing.assert_allclose(np.asarray(_ours(scanned, jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)
    llama_hf.save_hf(scanned, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), attn_implementation="eager")
    np.testing.assert_allclose(_theirs(back.eval(), IDS), _theirs(theirs, IDS), atol=1e-5, rtol=1e-5)


# peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing (not our code)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_on_attention_and_the_dense_mlp_exports_a_peft_adapter(checkpoint, tmp_path):
    pytest.importorskip("peft")
    from xlafit.models.lora import merge_lora

    _, folder = checkpoint
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    ours = apply_lora(llama_hf.from_hf(folder), targets, rank=4, alpha=8, rngs=nnx.Rngs(1))
    tuned, written = peft_tuned(ours, folder, tmp_path / "adapter", attn_implementation="eager")
    assert sorted(written) == sorted(targets)
    after = np.asarray(_ours(merge_lora(ours), jnp.array(IDS)))
    assert not np.allclose(after, np.asarray(_ours(llama_hf.from_hf(folder), jnp.array(IDS))), atol=1e-3)
    np.testing.assert_allclose(after, _theirs(tuned, IDS), atol=1e-4, rtol=1e-4)


# peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing (not our code)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_on_the_experts_beside_the_dense_mlp_exports_a_peft_adapter(checkpoint, tmp_path):
    """Gemma 4's experts sit beside its dense MLP (``layers.N.experts``): PEFT's
    target_parameters name them there, and transformers + peft give our logits."""
    peft = pytest.importorskip("peft")
    from xlafit.hf.peft import save_peft_adapter

    theirs, folder = checkpoint
    ours = apply_lora(llama_hf.from_hf(folder), ["q_proj", "down_proj", "experts"], rank=2, alpha=4, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(1)
    for _, value in nnx.state(ours, nnx.LoRAParam).flat_state():  # B too: the adapters change the logits
        value.set_value(jnp.asarray(rng.normal(0, 0.2, value.shape), value.dtype))
    save_peft_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(folder))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    tuned = _theirs(peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval(), IDS)
    adapted = np.asarray(_ours(ours, jnp.array(IDS)))
    assert not np.allclose(adapted, _theirs(theirs, IDS), atol=1e-2)
    np.testing.assert_allclose(adapted, tuned, atol=1e-4, rtol=1e-4)


def test_one_of_the_experts_weights_is_refused_naming_experts(checkpoint):
    _, folder = checkpoint
    with pytest.raises(ConfigError, match=r"^lora.targets names gate_up_proj, one of the experts' stacked weights: "):
        apply_lora(llama_hf.from_hf(folder), ["q_proj", "gate_up_proj"], rank=4, alpha=8, rngs=nnx.Rngs(1))


def test_the_llm_recipe_trains_from_an_export(tmp_path, monkeypatch):
    """Two full fine-tuning steps of the llm recipe with model.init_from_hf=<an xlafit export>
    of two layers (a sliding and a global one): the experts and the router's scales train, the
    load-balancing loss is logged (and not added: Gemma 4 has none)."""
    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("\n\n".join(f"document {i}: the quick brown fox. " * 3 for i in range(40)))
    clm.train_bpe([str(tmp_path / "text" / "a.txt")], 300, tmp_path / "tok")
    two = dict(num_hidden_layers=2, layer_types=KINDS[1:3], num_kv_shared_layers=0, use_double_wide_mlp=False)
    config = gemma4_config(**MOE, **two, vocab_size=300, vocab_size_per_layer_input=300).to_dict()
    model = llama_hf.LlamaForCausalLM(config_json.config_from_hf(config), rngs=nnx.Rngs(0))
    llama_hf.save_hf(model, tmp_path / "hf")
    cfg = load_config("llm", [
        f"model.init_from_hf={tmp_path / 'hf'}", f"data.data_dir={tmp_path / 'text'}",
        f"data.tokenizer={tmp_path / 'tok'}", f"run.run_dir={tmp_path / 'run'}", "data.seq_len=32",
        "data.global_batch=8", "trainer.stop_at_step=2", "trainer.log_every_steps=1", "optimizer.warmup_steps=0",
        "data.eval_fraction=0",
    ])  # fmt: skip
    result = xlafit.train_and_evaluate(cfg)
    assert int(result.state.step) == 2 and np.isfinite(result.history[-1]["loss"])
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("moe_aux_loss" in record for record in logged)
    layer = result.state.params["layers"][0]
    for before, after in [
        (model.layers[0].experts.gate_proj, layer["experts"]["gate_proj"]),
        (model.layers[0].router.per_expert_scale, layer["router"]["per_expert_scale"]),
    ]:
        assert not np.allclose(np.asarray(before[...]), np.asarray(after[...]))


def test_a_4_bit_base_quantizes_the_fused_experts_each_as_read(checkpoint):
    """Gemma 4's files hold a layer's experts in one tensor (``experts.gate_up_proj``): the
    4-bit reader quantized it as one kernel, then failed to stack it as one per expert (a
    reshape's TypeError, a QLoRA run of the 26B-A4B never started). Each expert is quantized as
    its own kernel: the same base, by fingerprint, as quantizing the full-precision model."""
    from xlafit.config import LoraConfig
    from xlafit.hf.quantized import from_hf_quantized
    from xlafit.models.lora import base_fingerprint
    from xlafit.run import with_lora

    _, folder = checkpoint
    read = from_hf_quantized(folder, "nf4", 8)
    lora = LoraConfig(rank=4, base_dtype="nf4", base_block=8, targets="q_proj,experts")
    direct = with_lora(llama_hf.from_hf(folder), lora, seed=0)
    tuned = with_lora(read, lora, seed=0)
    assert base_fingerprint(tuned) == base_fingerprint(direct)
    assert np.isfinite(np.asarray(_ours(tuned, jnp.asarray(IDS)), np.float32)).all()
