"""The gated delta rule: the chunked and the recurrent JAX forms against transformers'
PyTorch references (``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``)
and each other, gradients included, and packed segments that restart the state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlafit.models import delta_rule

torch = pytest.importorskip("torch")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

# Compiled once per shape (op-by-op dispatch of the scans is slow on a loaded CPU).
chunk_gated_delta_rule = jax.jit(delta_rule.chunk_gated_delta_rule, static_argnames=("chunk_size", "normalize_qk"))
recurrent_gated_delta_rule = jax.jit(delta_rule.recurrent_gated_delta_rule, static_argnames=("normalize_qk",))

# Float32 throughout; the chunked forms sum their products in another order than the references,
# and the order a CPU's matmul kernels take differs between machines: 1.8e-5 has been seen on one.
TOL = dict(atol=5e-5, rtol=1e-4)

B, T, HK, H, DK, DV = 2, 45, 2, 4, 8, 6  # T is no multiple of any chunk below; 2 value heads per key head


def _inputs(seed=0, strong_decay=False):
    rng = np.random.default_rng(seed)
    f32 = np.float32
    low = 0.5 if strong_decay else 0.01
    return dict(
        q=rng.normal(size=(B, T, HK, DK)).astype(f32),
        k=rng.normal(size=(B, T, HK, DK)).astype(f32),
        v=rng.normal(size=(B, T, H, DV)).astype(f32),
        g=-rng.uniform(low, 1.0, size=(B, T, H)).astype(f32),
        beta=rng.uniform(0.0, 1.0, size=(B, T, H)).astype(f32),
        initial_state=rng.normal(size=(B, H, DK, DV)).astype(f32),
    )


def _torch(fn, x, **kwargs):
    t = {name: torch.tensor(value) for name, value in x.items()}
    out, state = fn(
        t.pop("q"), t.pop("k"), t.pop("v"), **t, output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs
    )
    return out.numpy(), state.numpy()


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_the_chunked_form_equals_transformers(chunk_size):
    x = _inputs()
    out, state = chunk_gated_delta_rule(**x, chunk_size=chunk_size, normalize_qk=True)
    want_out, want_state = _torch(qwen3_5.torch_chunk_gated_delta_rule, x, chunk_size=chunk_size)
    np.testing.assert_allclose(np.asarray(out), want_out, **TOL)
    np.testing.assert_allclose(np.asarray(state), want_state, **TOL)
    # and transformers' recurrent form: the two references agree with each other too
    want_out, want_state = _torch(qwen3_5.torch_recurrent_gated_delta_rule, x)
    np.testing.assert_allclose(np.asarray(out), want_out, **TOL)
    np.testing.assert_allclose(np.asarray(state), want_state, **TOL)


def test_the_recurrent_form_equals_transformers():
    x = _inputs(1)
    out, state = recurrent_gated_delta_rule(**x, normalize_qk=True)
    want_out, want_state = _torch(qwen3_5.torch_recurrent_gated_delta_rule, x)
    np.testing.assert_allclose(np.asarray(out), want_out, **TOL)
    np.testing.assert_allclose(np.asarray(state), want_state, **TOL)


def test_decoding_token_by_token_continues_the_chunked_prefix():
    """A prefill in chunks, then one token at a time with the carried state: the whole sequence's outputs."""
    x = _inputs(2)
    whole, final = chunk_gated_delta_rule(**x, chunk_size=16, normalize_qk=True)
    head = {n: (v[:, :30] if n != "initial_state" else v) for n, v in x.items()}
    outs, state = [], chunk_gated_delta_rule(**head, chunk_size=16, normalize_qk=True)[1]
    for t in range(30, T):
        token = {n: v[:, t : t + 1] for n, v in x.items() if n != "initial_state"}
        out, state = recurrent_gated_delta_rule(**token, initial_state=state, normalize_qk=True)
        outs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np.asarray(whole)[:, 30:], **TOL)
    np.testing.assert_allclose(np.asarray(state), np.asarray(final), **TOL)


SEGMENTS = np.array([[1] * 10 + [2] * 20 + [3] * 13 + [0] * 2, [1] * 33 + [2] * 12])


def _loss(fn, q, k, v, g, beta, initial_state, **kwargs):
    out, state = fn(q, k, v, g, beta, initial_state=initial_state, normalize_qk=True, **kwargs)
    return jnp.sum(out * out) + jnp.sum(jnp.sin(state))


@pytest.mark.parametrize("segment_ids", [None, SEGMENTS], ids=["one", "packed"])
def test_gradients_of_the_chunked_form_equal_the_recurrent_forms(segment_ids):
    x = _inputs(3)
    args = tuple(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    argnums = tuple(range(6))
    chunked = jax.jit(
        jax.grad(lambda *a: _loss(chunk_gated_delta_rule, *a, chunk_size=16, segment_ids=segment_ids), argnums)
    )
    recurrent = jax.jit(jax.grad(lambda *a: _loss(recurrent_gated_delta_rule, *a, segment_ids=segment_ids), argnums))
    for got, want in zip(chunked(*args), recurrent(*args), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@pytest.mark.parametrize("chunk_size", [8, 16])
def test_packed_segments_start_from_an_empty_state(chunk_size):
    """Each segment of a packed row computes what it does alone, whether its boundaries fall
    inside a chunk or on a chunk's edge."""
    x = _inputs(4, strong_decay=True)
    x.pop("initial_state")
    packed, _ = chunk_gated_delta_rule(**x, chunk_size=chunk_size, segment_ids=SEGMENTS, normalize_qk=True)
    recurrent, _ = recurrent_gated_delta_rule(**x, segment_ids=SEGMENTS, normalize_qk=True)
    np.testing.assert_allclose(np.asarray(packed), np.asarray(recurrent), **TOL)
    for row, start, end in ((0, 10, 30), (0, 30, 43), (1, 33, 45)):
        alone = {n: v[row : row + 1, start:end] for n, v in x.items()}
        out, _ = chunk_gated_delta_rule(**alone, chunk_size=chunk_size, normalize_qk=True)
        np.testing.assert_allclose(np.asarray(packed)[row, start:end], np.asarray(out)[0], **TOL)


def test_bfloat16_inputs_are_computed_in_float32():
    x = _inputs(5)
    low = {n: jnp.asarray(v, jnp.bfloat16) for n, v in x.items()}
    out, state = chunk_gated_delta_rule(**low, chunk_size=16, normalize_qk=True)
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    want, _ = recurrent_gated_delta_rule(**{n: np.asarray(v, np.float32) for n, v in low.items()}, normalize_qk=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)
