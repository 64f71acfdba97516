"""Gemma 3 4B, 12B and 27B ship as ``Gemma3ForConditionalGeneration`` (``gemma3``: a vision
tower beside the text model, whose weights are under ``language_model.model.``, and a
``text_config`` that gives only its differences from transformers' defaults): xlafit reads
the text model, with the multimodal model's logits for text."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xlafit.hf import llama as llama_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = np.random.default_rng(0).integers(0, 97, (2, 12)).tolist()


def test_a_multimodal_checkpoint_gives_its_text_model_with_transformers_logits(tmp_path):
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
    theirs.save_pretrained(tmp_path, safe_serialization=True)
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
    mine = llama_hf.config_from_hf({"model_type": "gemma3", "text_config": given, "tie_word_embeddings": True})
    full = transformers.Gemma3TextConfig(**given).to_dict()
    assert mine == llama_hf.config_from_hf(full)
    assert (mine.vocab_size, mine.rope_theta, mine.rope_local_theta, mine.kinds[5]) == (
        262208, 1_000_000.0, 10_000.0, "full_attention"
    )  # fmt: skip
