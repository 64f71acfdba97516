"""Qwen3.5 (dense, text): a tiny random ``Qwen3_5ForCausalLM`` saved by transformers loads with
its logits (float32, 1e-4), from the multimodal checkpoint's text weights too, exports back,
isolates packed segments, and generates with the Gated DeltaNet state in the cache as
recomputing the prefix and ``transformers.generate`` do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import block_parameters, hf_greedy, peft_tuned
from xlafit.hf import config_json
from xlafit.hf import llama as llama_hf
from xlafit.models.generation import generate
from xlafit.models.lora import apply_lora, merge_lora

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Three Gated DeltaNet layers then a full-attention one (full_attention_interval 4), two value
# heads per key head, a rotary share of 0.25 (4 of 16 dimensions).
TEXT = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12, max_position_embeddings=128)  # fmt: skip
IDS = np.random.default_rng(0).integers(0, 97, (2, 40)).tolist()  # 40 tokens: chunks of 16 and a rest


def _randomize(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # norms, decays and biases too
            p.add_(torch.randn_like(p) * 0.1)
    return model.float().eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.Qwen3_5TextConfig(**TEXT)
    torch.manual_seed(0)
    model = _randomize(transformers.Qwen3_5ForCausalLM(config))
    folder = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(folder)
    return model, folder


def _theirs(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@nnx.jit
def run(model, ids, segment_ids=None, positions=None):  # compiled: op-by-op dispatch of the scans is slow
    return model(ids, segment_ids, positions)


@pytest.fixture(scope="module")
def ours(checkpoint):
    return llama_hf.from_hf(checkpoint[1], linear_chunk_size=16)


def test_a_checkpoint_loads_with_transformers_logits(checkpoint, ours):
    theirs, _ = checkpoint
    assert ours.cfg.family == "qwen3_5_text" and ours.cfg.kinds[3] == "full_attention"
    assert ours.cfg.rotary_dim == 4 and ours.cfg.attn_output_gate
    np.testing.assert_allclose(np.asarray(run(ours, jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)


def test_the_multimodal_checkpoint_gives_its_text_model(tmp_path):
    """Qwen3.5 ships as Qwen3_5ForConditionalGeneration: config.json's text_config, the text
    weights under model.language_model (the vision tower's are left alone)."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)  # fmt: skip
    config = transformers.Qwen3_5Config(text_config=TEXT, vision_config=vision)
    torch.manual_seed(1)
    theirs = _randomize(transformers.Qwen3_5ForConditionalGeneration(config))
    theirs.save_pretrained(tmp_path)
    ours = llama_hf.from_hf(tmp_path)
    np.testing.assert_allclose(np.asarray(run(ours, jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)


def test_an_export_loads_back_in_transformers(checkpoint, ours, tmp_path):
    theirs, _ = checkpoint
    llama_hf.save_hf(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(back).__name__ == "Qwen3_5ForCausalLM"
    np.testing.assert_allclose(_theirs(back, IDS), _theirs(theirs, IDS), atol=1e-6, rtol=1e-6)


def test_packed_sequences_see_only_their_own_segment(ours):
    """Attention by its segment mask, the DeltaNet layers by restarting the convolution and
    the state at each segment's first token. The second segment starts on a chunk's edge (16),
    so that each is chunked as it is alone (a boundary inside a chunk: tests/test_delta_rule.py)."""
    a, b = IDS[0][:16], IDS[1][:24]
    row = jnp.array([a + b])
    segments = jnp.array([[1] * 16 + [2] * 24])
    positions = jnp.array([list(range(16)) + list(range(24))])
    packed = np.asarray(run(ours, row, segments, positions))[0]
    np.testing.assert_allclose(packed[:16], np.asarray(run(ours, jnp.array([a])))[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(packed[16:], np.asarray(run(ours, jnp.array([b])))[0], atol=1e-5, rtol=1e-5)


PROMPTS = [IDS[0][:7], IDS[1][:3], IDS[0][10:30]]  # left-padded to 20: the padding writes no state


def test_generation_with_the_cache_equals_recomputing(ours):
    got = generate(ours, PROMPTS, 8)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        seq = list(prompt)
        for _ in range(8):  # the whole sequence each step, right-padded to one shape (causal: unseen)
            padded = jnp.array([seq + [0] * (28 - len(seq))])
            seq.append(int(jnp.argmax(run(ours, padded)[0, len(seq) - 1])))
        assert tokens == seq[len(prompt) :]


def test_generation_equals_transformers_generate(checkpoint, ours):
    theirs, _ = checkpoint
    assert generate(ours, PROMPTS, 8) == hf_greedy(theirs, PROMPTS, 8)


def test_scanning_the_repeating_block_equals_the_layers_one_by_one(tmp_path):
    """Five layers: a (DeltaNet, attention) block (the models' three DeltaNet layers and one
    attention layer, shortened) scanned twice, the last DeltaNet layer after it unscanned; the
    same logits and gradients (every tensor, by its Hugging Face name) of packed rows, the same
    generated tokens (the DeltaNet states and the attention's keys and values stacked in the
    cache)."""
    kinds = ["linear_attention", "full_attention"] * 2 + ["linear_attention"]
    config = transformers.Qwen3_5TextConfig(**{**TEXT, "num_hidden_layers": 5, "layer_types": kinds})
    _randomize(transformers.Qwen3_5ForCausalLM(config)).save_pretrained(tmp_path)
    ours = llama_hf.from_hf(tmp_path, linear_chunk_size=16)
    scanned = llama_hf.from_hf(tmp_path, linear_chunk_size=16, scan_layers=True)
    assert scanned.cfg.scan_period == 2 and len(scanned.tail) == 1
    ids, segments = jnp.array(IDS), jnp.array([[1] * 25 + [2] * 15] * 2)
    positions = jnp.array([[*range(25), *range(15)]] * 2)

    @nnx.jit
    def logits_and_gradients(m):
        def loss(m):
            logits = m(ids, segments, positions)
            return jnp.mean(jax.nn.log_softmax(logits)[:, :-1, 0]), logits

        (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(m)
        return logits, grads

    def by_name(m, grads):
        holder = nnx.clone(m)
        nnx.update(holder, grads)
        return llama_hf.to_hf_state(holder)

    want, got = logits_and_gradients(ours), logits_and_gradients(scanned)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-5, rtol=0)
    reference, grads = by_name(ours, want[1]), by_name(scanned, got[1])
    assert grads.keys() == reference.keys()
    for name, value in reference.items():
        np.testing.assert_allclose(grads[name], value, atol=1e-5, rtol=0, err_msg=name)
    assert generate(scanned, PROMPTS, 6) == generate(ours, PROMPTS, 6)


# peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing (not our code)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_on_the_deltanet_projections_exports_a_peft_adapter(checkpoint, tmp_path):
    """Adapters on the Gated DeltaNet layers' projections (and the gated q_proj) keep transformers' names."""
    pytest.importorskip("peft")
    plain, folder = checkpoint
    targets = ["q_proj", "in_proj_qkv", "in_proj_z", "out_proj", "down_proj"]
    ours = apply_lora(llama_hf.from_hf(folder, linear_chunk_size=16), targets, rank=4, alpha=8, rngs=nnx.Rngs(1))
    tuned, _ = peft_tuned(ours, folder, tmp_path / "adapter")
    want = _theirs(tuned, IDS)
    assert np.abs(want - _theirs(plain, IDS)).max() > 1e-2  # the adapters do change transformers' logits
    np.testing.assert_allclose(np.asarray(run(merge_lora(ours), jnp.array(IDS))), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("preset", "released", "billions"),
    [
        # Qwen/Qwen3.5-9B's text_config: transformers' defaults with the release's rotary base
        ("qwen3.5-9b", {}, 8.954),
        (
            "qwen3.5-27b",
            dict(
                hidden_size=5120,
                num_hidden_layers=64,
                num_attention_heads=24,
                intermediate_size=17408,
                linear_num_value_heads=48,
            ),
            26.896,
        ),  # fmt: skip
    ],
)
def test_the_dense_presets_are_what_the_released_configs_read_as_with_transformers_parameters(
    preset, released, billions
):
    """``model.preset=qwen3.5-9b`` / ``qwen3.5-27b``: every field equal to what xlafit reads from
    the released text config, and a block of four layers with as many parameters as
    transformers' model of it (built on the meta device); the whole text model's count."""
    import dataclasses

    from xlafit.models.llama import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
    config = transformers.Qwen3_5TextConfig(rope_parameters=rope, max_position_embeddings=262144, **released)
    ours = LlamaConfig.preset(preset)
    read = config_json.config_from_hf(config.to_dict())
    assert {f.name for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(read, f.name)} == set()
    count, theirs = block_parameters(ours, transformers.Qwen3_5ForCausalLM, config)
    assert count == theirs
    outside = 2 * ours.vocab_size * ours.hidden_size + ours.hidden_size  # embeddings, output layer, final norm
    total = outside + ours.num_layers // 4 * (count - outside)
    assert round(total / 1e9, 3) == billions
