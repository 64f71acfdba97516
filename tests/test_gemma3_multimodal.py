"""Gemma 3 4B, 12B and 27B ship as ``Gemma3ForConditionalGeneration`` (``gemma3``: a vision
tower beside the text model, whose weights are under ``language_model.model.``, and a
``text_config`` that gives only its differences from transformers' defaults): xlafit reads
the text model, with the multimodal model's logits for text."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xlafit.hf import config_json
from xlafit.hf import llama as llama_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = np.random.default_rng(0).integers(0, 97, (2, 12)).tolist()


def multimodal_gemma3(folder):
    """A tiny Gemma3ForConditionalGeneration with random weights, saved in ``folder``."""
    text = transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 2, rope_scaling={"rope_type": "linear", "factor": 8.0},
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4
    )
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in theirs.state_dict().items():
            if "inv_freq" not in name:
                p.add_(torch.randn_like(p) * 0.1)
    theirs.save_pretrained(folder, safe_serialization=True)
    return theirs


def test_a_multimodal_checkpoint_gives_its_text_model_with_transformers_logits(tmp_path):
    theirs = multimodal_gemma3(tmp_path)
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor(IDS)).logits.numpy()
    ours = llama_hf.from_hf(tmp_path)
    assert ours.cfg.family == "gemma3_text" and ours.cfg.rope_factor == 8.0
    got = nnx.jit(lambda m, ids: m(ids))(ours, jnp.array(IDS))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def test_a_released_text_config_reads_as_transformers_completes_it():
    """Gemma 3 4B's text_config (its sizes, rotary scaling and window; everything else
    transformers' default) reads as the full config transformers makes of it."""
    given = {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
    }  # fmt: skip
    mine = config_json.config_from_hf({"model_type": "gemma3", "text_config": given, "tie_word_embeddings": True})
    full = transformers.Gemma3TextConfig(**given).to_dict()
    assert mine == config_json.config_from_hf(full)
    assert (mine.vocab_size, mine.rope_theta, mine.rope_local_theta, mine.kinds[5]) == (
        262208, 1_000_000.0, 10_000.0, "full_attention"
    )  # fmt: skip
    # model.preset=gemma-3-4b: its text model's shape, for check --tpu and plan before any download
    from xlafit.models.llama import LlamaConfig

    assert LlamaConfig.preset("gemma-3-4b") == mine


# peft reads transformers 5's deprecated is_gradient_checkpointing (not our code)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_an_adapter_of_a_multimodal_base_applies_to_it_in_peft_and_loads_back(tmp_path):
    """The adapter of a model read from a multimodal checkpoint names the modules transformers
    gives its text model there (``model.language_model.``), and targets those alone: with the
    text model's names, PEFT adapted the vision tower's layers of the same names and loaded
    none of the tensors, with a warning and the base model's logits."""
    peft = pytest.importorskip("peft")
    from xlafit.hf.peft import load_peft_adapter, save_peft_adapter
    from xlafit.models.lora import apply_lora, lora_modules, merge_lora

    multimodal_gemma3(tmp_path / "base")
    assert config_json.is_multimodal(tmp_path / "base")
    assert config_json.causal_lm_class(tmp_path / "base") == ("Gemma3ForConditionalGeneration", True)
    ours = apply_lora(
        llama_hf.from_hf(tmp_path / "base"), ["q_proj", "v_proj", "down_proj"], rank=4, alpha=8, rngs=nnx.Rngs(0)
    )
    rng = np.random.default_rng(1)
    for _, layer in lora_modules(ours):  # trained adapters: B is zero at initialisation
        layer.lora_b[...] = rng.normal(size=layer.lora_b[...].shape).astype(np.float32) * 0.1
    save_peft_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"), multimodal=True)
    want = np.asarray(nnx.jit(lambda m, ids: m(ids))(merge_lora(ours), jnp.array(IDS)))

    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    assert type(base).__name__ == "Gemma3ForConditionalGeneration"
    tuned = peft.PeftModel.from_pretrained(base.float().eval(), tmp_path / "adapter")
    adapted = {name for name, _ in tuned.named_modules() if name.endswith("lora_A")}
    assert adapted and all(".language_model." in name for name in adapted)  # not the vision tower's
    with torch.no_grad():
        got = tuned(input_ids=torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

    back = load_peft_adapter(llama_hf.from_hf(tmp_path / "base"), tmp_path / "adapter")
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, ids: m(ids))(merge_lora(back), jnp.array(IDS))), want)
