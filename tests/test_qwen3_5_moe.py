"""Qwen3.5-MoE (Qwen3.5 35B-A3B's text model, ``qwen3_5_moe_text``): a tiny random
``Qwen3_5MoeForCausalLM`` saved by transformers loads with its logits (float32, 1e-4), from the
multimodal checkpoint's text weights and from transformers' fused expert tensors too; the
export loads back in transformers; the cached generation equals recomputing the prefix and
``transformers.generate``; the llm recipe's model and loss train it from the local
checkpoint, the shared expert and its gate included; LoRA on the shared expert exports a
PEFT adapter."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import block_parameters, hf_greedy, packed_rows, peft_tuned
from xlafit.errors import HFFormatError
from xlafit.hf import config_json
from xlafit.hf import llama as llama_hf
from xlafit.models.generation import generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# A Gated DeltaNet layer then a full-attention one, every layer a sparse block: 8 experts of
# 16, 2 a token, and a shared expert of 24 behind its gate. A vocabulary of 320 holds the
# training test's tokenizer (300).
TEXT = dict(vocab_size=320, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            max_position_embeddings=128)  # fmt: skip
IDS = np.random.default_rng(0).integers(0, 320, (2, 24)).tolist()


def _randomize(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # norms, decays, the router and the shared expert's gate too
            p.add_(torch.randn_like(p) * 0.1)
    return model.float().eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = _randomize(transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TEXT)))
    folder = tmp_path_factory.mktemp("qwen3_5_moe")
    model.save_pretrained(folder)
    return model, folder


def _theirs(model, ids, **kwargs):
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.numpy()


@nnx.jit
def run(model, ids):  # compiled: op-by-op dispatch of the scans and the grouped products is slow
    return model(ids)


@pytest.fixture(scope="module")
def ours(checkpoint):
    return llama_hf.from_hf(checkpoint[1], linear_chunk_size=16)


def test_a_checkpoint_loads_with_transformers_logits(checkpoint, ours):
    theirs, _ = checkpoint
    cfg = ours.cfg
    assert cfg.family == "qwen3_5_moe_text" and cfg.kinds == ("linear_attention", "full_attention")
    assert cfg.moe_layers == (True, True) and cfg.norm_topk_prob and cfg.shared_expert_intermediate_size == 24
    np.testing.assert_allclose(np.asarray(run(ours, jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)


def test_the_parity_needs_the_shared_expert(checkpoint, ours):
    """With the shared experts' outputs zeroed the logits are far from transformers'."""
    theirs, _ = checkpoint
    silenced = nnx.clone(ours)
    for i in range(2):
        down = silenced.layer_at(i)[0].mlp.shared_expert.down_proj.kernel
        down[...] = jnp.zeros_like(down[...])
    assert np.abs(np.asarray(run(silenced, jnp.array(IDS))) - _theirs(theirs, IDS)).max() > 1e-2


def test_the_multimodal_checkpoint_gives_its_text_model(tmp_path):
    """Qwen3.5 35B-A3B ships as Qwen3_5MoeForConditionalGeneration: config.json's text_config,
    the text weights under model.language_model (the vision tower's are left alone)."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)  # fmt: skip
    config = transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=vision)
    torch.manual_seed(1)
    theirs = _randomize(transformers.Qwen3_5MoeForConditionalGeneration(config))
    theirs.save_pretrained(tmp_path)
    mine = llama_hf.from_hf(tmp_path, linear_chunk_size=16)
    assert mine.cfg.family == "qwen3_5_moe_text"
    np.testing.assert_allclose(np.asarray(run(mine, jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_adapter_of_a_multimodal_qwen_base_names_the_text_model_that_causal_lm_loads(tmp_path):
    """AutoModelForCausalLM loads a Qwen3.5 multimodal checkpoint as its text model alone
    (Qwen3_5MoeForCausalLM, model.layers...), unlike Gemma 3's and 4's: an adapter named under
    model.language_model. (the multimodal model's names) matched no module there, and PEFT gave
    the base's logits with a warning. The export names the text model's modules for it."""
    from xlafit.models.lora import apply_lora, merge_lora

    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)  # fmt: skip
    config = transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=vision)
    torch.manual_seed(1)
    _randomize(transformers.Qwen3_5MoeForConditionalGeneration(config)).save_pretrained(tmp_path / "base")
    assert config_json.is_multimodal(tmp_path / "base")
    assert config_json.causal_lm_class(tmp_path / "base") == ("Qwen3_5MoeForCausalLM", False)
    ours = apply_lora(llama_hf.from_hf(tmp_path / "base", linear_chunk_size=16), ["q_proj", "v_proj"], rank=4,
                      alpha=8, rngs=nnx.Rngs(0))  # fmt: skip
    tuned, _ = peft_tuned(ours, tmp_path / "base", tmp_path / "adapter")
    assert type(tuned.get_base_model()).__name__ == "Qwen3_5MoeForCausalLM"
    want = np.asarray(run(merge_lora(ours), jnp.array(IDS)))
    assert (
        np.abs(want - np.asarray(run(llama_hf.from_hf(tmp_path / "base", linear_chunk_size=16), jnp.array(IDS)))).max()
        > 1e-3
    )
    np.testing.assert_allclose(_theirs(tuned, IDS), want, atol=1e-4, rtol=1e-4)


def test_fused_expert_tensors_load_too(checkpoint, tmp_path):
    """transformers' in-memory layout (gate_up_proj [E, 2f, h], down_proj [E, h, f]) in the file."""
    from safetensors.numpy import save_file

    theirs, folder = checkpoint
    state = {k: v.numpy() for k, v in theirs.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    mine = llama_hf.from_hf(tmp_path, linear_chunk_size=16)
    np.testing.assert_allclose(np.asarray(run(mine, jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)


def test_an_export_loads_back_in_transformers(checkpoint, ours, tmp_path):
    theirs, _ = checkpoint
    llama_hf.save_hf(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(back).__name__ == "Qwen3_5MoeForCausalLM"
    np.testing.assert_allclose(_theirs(back, IDS), _theirs(theirs, IDS), atol=1e-6, rtol=1e-6)


def test_an_export_transformers_cannot_describe_is_refused(ours, tmp_path):
    """Qwen3.5-MoE's config.json has every layer sparse and a shared expert."""
    for change in ({"mlp_only_layers": (0,)}, {"shared_expert_intermediate_size": 0}):
        cfg = dataclasses.replace(ours.cfg, **change)
        with pytest.raises(HFFormatError, match="every layer sparse"):
            config_json.hf_config(cfg)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_attention_biases_are_refused(family):
    """Qwen3.5's attention_bias puts a bias on o_proj too, which xlafit's attention has not:
    read, it would be dropped and the logits wrong."""
    hf = {"model_type": family, "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 4,
          "num_attention_heads": 4, "head_dim": 16, "attention_bias": True}  # fmt: skip
    with pytest.raises(HFFormatError, match="attention_bias=true Qwen3.5 models"):
        config_json.config_from_hf(hf)


PROMPTS = [IDS[0][:7], IDS[1][:3]]  # left-padded to 7: the padding writes no state


def test_generation_with_the_cache_equals_recomputing_and_transformers(checkpoint, ours):
    theirs, _ = checkpoint
    got = generate(ours, PROMPTS, 6)
    rows = [list(p) for p in PROMPTS]
    for _ in range(6):  # the whole sequences each step, right-padded to the shape compiled above (causal: unseen)
        logits = run(ours, jnp.array([row + [0] * (24 - len(row)) for row in rows]))
        for i, row in enumerate(rows):
            row.append(int(jnp.argmax(logits[i, len(row) - 1])))
    assert got == [row[len(p) :] for row, p in zip(rows, PROMPTS, strict=True)]
    assert got == hf_greedy(theirs, PROMPTS, 6, eos_token_id=None)


def test_the_llm_recipe_trains_it_from_the_local_checkpoint(checkpoint, strategy1):
    """Two steps of the llm recipe's model (``model.init_from_hf``: the checkpoint's router
    loss coefficient, 0.001) and loss on packed rows: the loss adds the load-balancing loss,
    and the weights move, the shared expert and its gate among them."""
    import optax

    import xlafit
    from xlafit.config import TrainerConfig
    from xlafit.data.dataset import ArrayDataset
    from xlafit.recipes import llm, load_config

    _, folder = checkpoint
    cfg = load_config("llm", [f"model.init_from_hf={folder}", "model.moe.impl=dense"])
    model = llm.build_llama(cfg, 320)
    assert model.cfg.router_aux_loss_coef == 0.001 and model.cfg.moe_impl == "dense"
    before = llama_hf.to_hf_state(model)
    trainer = xlafit.Trainer(
        model, llm.loss_fn, optax.sgd(0.05), strategy=strategy1, global_batch=4,
        config=TrainerConfig(epochs=1, log_every_steps=1),
    )  # fmt: skip
    result = trainer.fit(ArrayDataset(packed_rows(8, 16, 320)))
    assert [r["step"] for r in result.history] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["moe_aux_loss"] > 0 for r in result.history)
    nnx.update(model, result.state.params)
    after = llama_hf.to_hf_state(model)
    for name in ("model.layers.0.mlp.shared_expert_gate.weight", "model.layers.1.mlp.shared_expert.up_proj.weight",
                 "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.3.down_proj.weight",
                 "model.layers.0.linear_attn.in_proj_qkv.weight"):  # fmt: skip
        assert np.abs(after[name] - before[name]).max() > 0, name


# peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing (not our code)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_on_the_shared_expert_and_the_router_exports_a_peft_adapter_transformers_applies(checkpoint, tmp_path):
    """gate_proj, up_proj and down_proj are the shared expert's (the routed experts' stacked
    weights take no adapters), as PEFT finds them in transformers' model. The router (`gate`)
    is a module of its own there (Qwen3_5MoeTopKRouter), which PEFT refuses as a target module
    ("not supported"): its adapter is a target parameter, and xlafit reads it back."""
    pytest.importorskip("peft")
    from xlafit.hf.peft import load_peft_adapter
    from xlafit.models.lora import apply_lora, merge_lora

    plain, folder = checkpoint
    targets = ["q_proj", "in_proj_qkv", "gate_proj", "up_proj", "down_proj", "gate"]
    mine = apply_lora(llama_hf.from_hf(folder, linear_chunk_size=16), targets, rank=4, alpha=8, rngs=nnx.Rngs(1))
    tuned, written = peft_tuned(mine, folder, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert "gate" not in written and config["target_parameters"] == ["mlp.gate.weight"]
    want = _theirs(tuned, IDS)
    assert np.abs(want - _theirs(plain, IDS)).max() > 1e-2  # the adapters do change transformers' logits
    np.testing.assert_allclose(np.asarray(run(merge_lora(mine), jnp.array(IDS))), want, atol=1e-4, rtol=1e-4)
    back = load_peft_adapter(llama_hf.from_hf(folder, linear_chunk_size=16), tmp_path / "adapter")
    np.testing.assert_allclose(np.asarray(run(merge_lora(back), jnp.array(IDS))), want, atol=1e-4, rtol=1e-4)


def test_the_preset_is_what_the_released_config_reads_as_with_transformers_parameters():
    """``model.preset=qwen3.5-35b-a3b``: the fields xlafit reads from the released text
    config (transformers' defaults are its shape; the release's rotary base and context). Its
    first block of four layers has as many parameters as transformers' model of it (built on
    the meta device), and the ten blocks with the embeddings and the output layer 34.66B; its
    model FLOPs count the shared expert."""
    from xlafit.models.llama import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
    released = transformers.Qwen3_5MoeTextConfig(rope_parameters=rope, max_position_embeddings=262144)
    preset = LlamaConfig.preset("qwen3.5-35b-a3b")
    read = config_json.config_from_hf(released.to_dict())
    differ = {f.name for f in dataclasses.fields(preset) if getattr(preset, f.name) != getattr(read, f.name)}
    assert differ <= {"intermediate_size"}, differ  # the dense MLP's width, which no layer has
    count, theirs = block_parameters(preset, transformers.Qwen3_5MoeForCausalLM, released)
    assert count == theirs
    outside = 2 * preset.vocab_size * preset.hidden_size + preset.hidden_size  # embeddings, output layer, final norm
    assert outside + 10 * (count - outside) == 34_660_610_688
    # The model FLOPs count each token's shared expert (gate, up, down) and its gate, 6 FLOPs a weight.
    alone = dataclasses.replace(preset, shared_expert_intermediate_size=0).train_flops_per_token(4096)
    assert preset.train_flops_per_token(4096) - alone == 6 * 40 * (3 * 2048 * 512 + 2048)
