"""The Gated DeltaNet layer against transformers' ``Qwen3_5GatedDeltaNet`` on random weights,
its decoding state against the whole sequence, and packed rows against each segment alone."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xlafit.models.gated_deltanet import GatedDeltaNet
from xlafit.models.llama_config import LlamaConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

SIZES = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
             linear_conv_kernel_dim=4)  # fmt: skip


@pytest.fixture(scope="module")
def layers():
    """transformers' layer with random weights (norm, decay and bias too) and ours with the same."""
    config = transformers.Qwen3_5TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layer_types=["linear_attention"], **SIZES,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = qwen3_5.Qwen3_5GatedDeltaNet(config, layer_idx=0).float().eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, linear_chunk_size=16, **SIZES
    )
    ours = GatedDeltaNet(cfg, nnx.Rngs(0))
    weights = {name: p.detach().numpy() for name, p in theirs.named_parameters()}
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        getattr(ours, name).kernel[...] = jnp.asarray(weights[f"{name}.weight"].T)
    ours.conv1d.kernel[...] = jnp.asarray(weights["conv1d.weight"].T)  # [C, 1, K] -> [K, 1, C]
    ours.dt_bias[...] = jnp.asarray(weights["dt_bias"])
    ours.A_log[...] = jnp.asarray(weights["A_log"])
    ours.norm.scale[...] = jnp.asarray(weights["norm.weight"])
    return theirs, ours


@nnx.jit
def run(layer, x, segment_ids=None):  # compiled: op-by-op dispatch of the scans is slow on a CPU
    return layer(x, segment_ids)


@nnx.jit
def cached(layer, x, state, visible):
    return layer.cached(x, state, visible)


X = np.random.default_rng(0).normal(size=(2, 37, 32)).astype(np.float32)  # 37 tokens: chunks of 16 and a rest


def test_the_layer_equals_transformers(layers):
    theirs, ours = layers
    with torch.no_grad():
        want = theirs(torch.tensor(X)).numpy()
    np.testing.assert_allclose(np.asarray(run(ours, jnp.asarray(X))), want, atol=1e-4, rtol=1e-4)


def test_decoding_with_the_state_equals_the_whole_sequence(layers):
    """A prefill of 20 tokens, then one token at a time: the convolution's inputs and the
    delta rule's state carried in the state."""
    _, ours = layers
    whole = np.asarray(run(ours, jnp.asarray(X)))
    visible = jnp.ones((2, 1), bool)
    out, state = cached(ours, jnp.asarray(X[:, :20]), ours.empty_state(2), jnp.ones((2, 20), bool))
    outs = [np.asarray(out)]
    for t in range(20, X.shape[1]):
        out, state = cached(ours, jnp.asarray(X[:, t : t + 1]), state, visible)
        outs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), whole, atol=1e-5, rtol=1e-5)


def test_left_padding_that_is_not_visible_changes_nothing(layers):
    _, ours = layers
    alone, _ = cached(ours, jnp.asarray(X[:1, :9]), ours.empty_state(1), jnp.ones((1, 9), bool))
    padded = jnp.concatenate([jnp.full((1, 3, 32), 5.0), jnp.asarray(X[:1, :9])], axis=1)
    visible = jnp.array([[False] * 3 + [True] * 9])
    out, _ = cached(ours, padded, ours.empty_state(1), visible)
    np.testing.assert_allclose(np.asarray(out)[:, 3:], np.asarray(alone), atol=1e-5, rtol=1e-5)


def test_packed_segments_see_only_their_own(layers):
    """The convolution and the delta rule both restart at a segment's first token."""
    _, ours = layers
    segments = jnp.array([[1] * 14 + [2] * 20 + [0] * 3, [1] * 37])
    packed = np.asarray(run(ours, jnp.asarray(X), segments))
    for start, end in ((0, 14), (14, 34)):
        alone = np.asarray(run(ours, jnp.asarray(X[:1, start:end])))
        np.testing.assert_allclose(packed[0, start:end], alone[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(packed[1], np.asarray(run(ours, jnp.asarray(X[1:])))[0], atol=1e-5, rtol=1e-5)
