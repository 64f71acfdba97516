"""Gemma 4's text models (``gemma4_text``, dense): a random tiny checkpoint with every
feature on (per-layer inputs, key/value sharing across the last layers, values equal to keys
on global layers, global layers with their own head size and key/value heads, proportional
rotation on part of a global head, a doubled MLP on the sharing layers) loads with
transformers' logits (float32, 1e-4), keeps packed segments apart, generates with the cache
as recomputing does and as ``transformers.generate`` does, exports back, and fine-tunes with
LoRA into a PEFT adapter that transformers + peft apply with the same logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import long_form, peft_tuned, recomputed
from xlafit.errors import ConfigError
from xlafit.hf import config_json
from xlafit.hf import llama as llama_hf
from xlafit.models.generation import generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
KINDS = ["sliding_attention", "sliding_attention", "full_attention"] * 2
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 16)).tolist()


def gemma4_config(**overrides):
    """Six layers (sliding, sliding, global, twice); the last three share the keys and values
    of layers 1 (sliding) and 2 (global)."""
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=4,
        layer_types=KINDS, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, attention_k_eq_v=True,
        num_kv_shared_layers=3, use_double_wide_mlp=True, final_logit_softcapping=30.0, max_position_embeddings=128,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
    )  # fmt: skip
    settings.update(overrides)
    config = transformers.Gemma4TextConfig(**settings)
    config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A transformers Gemma4ForCausalLM with random weights (norms and layer scalars too), saved."""
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(gemma4_config()).float().eval()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if "inv_freq" not in name:
                p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("gemma4")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@nnx.jit
def run(model, ids, segment_ids=None, positions=None):  # compiled: op by op, a forward takes seconds
    return model(ids, segment_ids, positions)


@nnx.jit
def cached(model, ids, positions, cache, start, visible):
    return model.cached(ids, positions, cache, start, visible)


def _theirs(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def test_the_config_reads_every_gemma4_setting(checkpoint):
    _, folder = checkpoint
    cfg = llama_hf.from_hf(folder).cfg
    assert (cfg.family, cfg.head_dim, cfg.global_head_dim, cfg.kv_heads, cfg.global_kv_heads) == (
        "gemma4_text", 16, 32, 2, 1
    )  # fmt: skip
    assert (cfg.per_layer_input_size, cfg.num_kv_shared_layers, cfg.attention_k_eq_v) == (8, 3, True)
    assert (cfg.rope_type, cfg.partial_rotary_factor, cfg.rope_local_theta) == ("proportional", 0.25, 10_000.0)
    assert cfg.kv_sources == (0, 1, 2, 1, 1, 2)


def test_a_checkpoint_loads_with_transformers_logits(checkpoint):
    theirs, folder = checkpoint
    ours = llama_hf.from_hf(folder)
    np.testing.assert_allclose(np.asarray(run(ours, jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)


def test_an_export_loads_back_in_transformers(checkpoint, tmp_path):
    theirs, folder = checkpoint
    llama_hf.save_hf(llama_hf.from_hf(folder), tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert type(back).__name__ == "Gemma4ForCausalLM"
    np.testing.assert_allclose(_theirs(back, IDS), _theirs(theirs, IDS), atol=1e-5, rtol=1e-5)


def test_packed_sequences_see_only_their_own_segment(checkpoint):
    """The shared layers attend over their source's keys within each segment, windows by position."""
    _, folder = checkpoint
    ours = llama_hf.from_hf(folder)
    a, b = IDS[0][:9], IDS[1][:7]
    packed = np.asarray(
        run(ours, jnp.array([a + b]), jnp.array([[1] * 9 + [2] * 7]), jnp.array([[*range(9), *range(7)]]))
    )
    np.testing.assert_allclose(packed[0, :9], np.asarray(run(ours, jnp.array([a])))[0], atol=1e-5)
    np.testing.assert_allclose(packed[0, 9:], np.asarray(run(ours, jnp.array([b])))[0], atol=1e-5)


def test_the_cache_holds_the_layers_that_compute_keys_and_values_only(checkpoint):
    """Layers 3-5 share the keys and values of layers 1 and 2: the cache has entries for
    layers 0-2 alone, each of its kind's shape (a global layer's 1 head of 32)."""
    _, folder = checkpoint
    ours = llama_hf.from_hf(folder)
    cache = ours.empty_cache(2, 10)
    assert [c.keys.shape for c in cache] == [(2, 10, 2, 16), (2, 10, 2, 16), (2, 10, 1, 32)]
    ids = jnp.array(IDS)[:, :10]
    visible = jnp.ones((2, 10), bool)
    logits, cache = cached(ours, ids, jnp.broadcast_to(jnp.arange(10), (2, 10)), cache, jnp.int32(0), visible)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(run(ours, ids)), atol=1e-5)
    # What the shared layers read is what their sources wrote: with the global source's entry
    # (layer 2's) zeroed, the next token's logits change, though layer 2 writes its own slot anew.
    step = (jnp.array(IDS)[:, 10:11], jnp.full((2, 1), 10), jnp.int32(10), jnp.ones((2, 11), bool))
    cache = jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, 1), (0, 0), (0, 0))), cache)
    kept, _ = cached(ours, step[0], step[1], cache, step[2], step[3])
    np.testing.assert_allclose(np.asarray(kept[:, 0]), np.asarray(run(ours, jnp.array(IDS)[:, :11]))[:, 10], atol=1e-5)
    zeroed = (*cache[:2], type(cache[2])(jnp.zeros_like(cache[2].keys), cache[2].values))
    changed, _ = cached(ours, step[0], step[1], zeroed, step[2], step[3])
    assert not np.allclose(np.asarray(changed), np.asarray(kept), atol=1e-3)


def test_generation_with_the_cache_equals_recomputing_and_transformers(checkpoint):
    """Past the sliding window (4), prompts of two lengths (left-padded)."""
    theirs, folder = checkpoint
    ours = llama_hf.from_hf(folder)
    prompts = [IDS[0][:6], IDS[1][:3]]
    got = generate(ours, prompts, 9)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == recomputed(ours, prompt, 9)
        with torch.no_grad():
            out = theirs.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False, eos_token_id=None)
        assert tokens == out[0, len(prompt) :].tolist()


# peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing (not our code)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_exports_a_peft_adapter_transformers_applies(checkpoint, tmp_path):
    pytest.importorskip("peft")
    from xlafit.models.lora import apply_lora, merge_lora

    _, folder = checkpoint
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "per_layer_input_gate", "per_layer_projection"]
    ours = apply_lora(llama_hf.from_hf(folder), targets, rank=4, alpha=8, rngs=nnx.Rngs(1))
    tuned, written = peft_tuned(ours, folder, tmp_path / "adapter", attn_implementation="eager")
    assert sorted(written) == sorted(targets)
    merged = merge_lora(ours)
    before = np.asarray(run(llama_hf.from_hf(folder), jnp.array(IDS)))
    after = np.asarray(run(merged, jnp.array(IDS)))
    assert not np.allclose(before, after, atol=1e-3)
    np.testing.assert_allclose(after, _theirs(tuned, IDS), atol=1e-4, rtol=1e-4)


def test_the_layer_scalars_are_read_and_not_trained(checkpoint):
    """``layer_scalar`` is a buffer in transformers: read with the weights, left out of
    what the trainer's default filter (``nnx.Param``) trains."""
    theirs, folder = checkpoint
    ours = llama_hf.from_hf(folder)
    assert float(ours.layers[4].layer_scalar[...][0]) == pytest.approx(float(theirs.model.layers[4].layer_scalar[0]))
    trained = jax.tree.leaves(nnx.state(ours, nnx.Param))
    assert len(trained) == len(jax.tree.leaves(nnx.state(ours))) - 6


def test_a_multimodal_checkpoint_gives_its_text_model(checkpoint, tmp_path):
    """Gemma 4 ships as Gemma4ForConditionalGeneration (``gemma4``: vision and audio towers
    beside the text model, whose weights are under ``model.language_model.``): xlafit reads
    its text model, with the multimodal model's logits for text."""
    theirs, _ = checkpoint
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, global_head_dim=16,
    )  # fmt: skip
    config = transformers.Gemma4Config(text_config=gemma4_config().to_dict(), vision_config=vision.to_dict())
    both = transformers.Gemma4ForConditionalGeneration(config).float().eval()
    both.model.language_model.load_state_dict(theirs.model.state_dict())
    both.save_pretrained(tmp_path, safe_serialization=True)
    with torch.no_grad():
        want = both(input_ids=torch.tensor(IDS)).logits.numpy()
    ours = llama_hf.from_hf(tmp_path)
    assert ours.cfg.family == "gemma4_text" and ours.cfg.num_kv_shared_layers == 3
    np.testing.assert_allclose(np.asarray(run(ours, jnp.array(IDS))), want, atol=1e-4, rtol=1e-4)


def test_key_value_sharing_layers_are_refused_scanned(checkpoint):
    _, folder = checkpoint
    with pytest.raises(ConfigError, match=r"share earlier layers. keys and values .* use model.scan_layers=false"):
        llama_hf.from_hf(folder, scan_layers=True)


BLOCK = ["sliding_attention", "full_attention"]  # the models' (5 sliding, 1 global) block, shortened


def _scan_configs():
    """Gemma 3 of five layers: two blocks of (sliding, global), then a sliding layer
    unscanned; Gemma 4 (no key/value sharing: the larger dense models' layout; its last layer
    is global) of two such blocks."""
    gemma3 = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        layer_types=BLOCK * 2 + ["sliding_attention"],
    )  # fmt: skip
    gemma4 = gemma4_config(num_hidden_layers=4, layer_types=BLOCK * 2, num_kv_shared_layers=0)
    return {"gemma3_text": gemma3.to_dict(), "gemma4_text": gemma4.to_dict()}


@pytest.mark.parametrize(
    "family",
    [
        "gemma3_text",
        pytest.param(
            "gemma4_text",
            marks=long_form(
                23,
                covered_by="test_gemma4_moe.py::test_the_repeating_block_scans_to_transformers_logits (Gemma 4's "
                "block scanned) and this test's gemma3_text case (the scanned gradients)",
            ),
        ),
    ],
)
def test_scanning_the_repeating_block_equals_the_layers_one_by_one(family, tmp_path):
    """scan_layers=True on a model of sliding and global layers scans its (sliding, global)
    block (twice; Gemma 3's last layer after it unscanned): the same logits, the same
    gradients (every tensor, by its Hugging Face name), the same generated tokens."""
    cfg = config_json.config_from_hf(_scan_configs()[family])
    model = llama_hf.LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    for i, (_, value) in enumerate(nnx.state(model, nnx.Param).flat_state()):  # norms off their start too
        value.set_value(value[...] + 0.1 * jax.random.normal(jax.random.key(i), value.shape))
    llama_hf.save_hf(model, tmp_path)
    ids = jnp.array(IDS)

    @nnx.jit  # compiled: op by op, the reference's gradients take most of a minute
    def compiled(m):
        def loss(m):
            return jnp.mean(jax.nn.log_softmax(m(ids))[:, :-1, 0])

        return m(ids), nnx.grad(loss)(m)

    def logits_and_gradients(m):
        logits, grads = compiled(m)
        holder = nnx.clone(m)
        nnx.update(holder, grads)
        return np.asarray(logits), llama_hf.to_hf_state(holder)

    logits, reference = logits_and_gradients(model)
    noise = {"logits": 0.0, **{name: 0.0 for name in reference}}
    if family == "gemma4_text":
        # float32's own noise in this Gemma 4 (per-layer inputs, the embedding's gradient
        # summed over every layer's path): the unscanned model with its layers rematerialized
        # differs from itself without (1.3e-5 in the embedding's gradient); the scanned one
        # may differ by twice that.
        remat_logits, remat = logits_and_gradients(llama_hf.from_hf(tmp_path, remat="full"))
        noise = {"logits": 2 * np.abs(remat_logits - logits).max()}
        noise.update({name: 2 * np.abs(remat[name] - value).max() for name, value in reference.items()})
    scanned = llama_hf.from_hf(tmp_path, scan_layers=True, remat="full")  # remat inside the scanned block too
    assert scanned.cfg.scan_period == 2 and len(scanned.tail) == (0 if family == "gemma4_text" else 1)
    stacked = nnx.state(scanned, nnx.Param)["layers"]["layers"][1]["mlp"]["up_proj"]["kernel"]
    assert stacked.shape == ((2, 64, 48) if family == "gemma4_text" else (2, 64, 96))
    scanned_logits, grads = logits_and_gradients(scanned)
    np.testing.assert_allclose(scanned_logits, logits, atol=1e-5 + noise["logits"], rtol=0)
    assert grads.keys() == reference.keys()
    for name, value in reference.items():
        np.testing.assert_allclose(grads[name], value, atol=1e-5 + noise[name], rtol=0, err_msg=name)
    prompts = [IDS[0][:6], IDS[1][:3]]
    assert generate(llama_hf.from_hf(tmp_path, scan_layers=True), prompts, 7) == generate(model, prompts, 7)
