"""Splash attention (the Pallas flash-attention kernel for TPUs) in the Llama decoder: its
numbers against XLA's attention (the kernel interpreted on the CPU), and its compiled
program for a TPU target (the TPU compiler on the CPU), FLOPs counted from the program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlafit.check import check_recipe
from xlafit.models.attention import attention as xla_attention
from xlafit.models.attention import causal_mask
from xlafit.models.splash import splash_attention, unsupported
from xlafit.predict.hlo import kernel_flops


def test_splash_matches_xla_attention_with_gqa_and_packed_segments():
    b, t, heads, kv, d = 1, 256, 2, 1, 64
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(b, t, heads, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv, d)), jnp.float32) for _ in range(2))
    segments = jnp.asarray([[1] * 100 + [2] * 120 + [0] * 36], jnp.int32)  # two documents, then padding
    mask = segments[:, None, :, None] == segments[:, None, None, :]

    def loss(attend, q, k, v):
        return (attend(q, k, v) ** 2).sum()

    ours = lambda q, k, v: splash_attention(q, k, v, segments, interpret=True)  # noqa: E731
    xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)  # noqa: E731
    np.testing.assert_allclose(ours(q, k, v), xla(q, k, v), atol=1e-5)
    grads = jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(lambda *a: loss(xla, *a), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_splash_takes_a_sliding_window_and_the_layers_own_scale():
    """A Gemma sliding layer's attention: the last ``window`` keys of the query's own segment,
    scores scaled by the layer's scale (Gemma 4's 1: its queries and keys are normed), as
    the XLA path's mask computes it from positions within each segment."""
    b, t, heads, kv, d, window = 1, 256, 2, 1, 64, 40
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(b, t, heads, d)) / 8, jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv, d)), jnp.float32) for _ in range(2))
    segments = jnp.asarray([[1] * 100 + [2] * 156], jnp.int32)
    positions = jnp.asarray([list(range(100)) + list(range(156))])
    mask = jnp.asarray(causal_mask(t))[None, None] & (segments[:, None, :, None] == segments[:, None, None, :])
    mask = mask & (positions[:, None, :, None] - positions[:, None, None, :] < window)
    ours = splash_attention(q, k, v, segments, interpret=True, window=window, scale=1.0)
    np.testing.assert_allclose(ours, xla_attention(q, k, v, mask, 1.0), atol=1e-5)


def test_splash_refuses_shapes_it_cannot_tile():
    assert "multiple of 128" in unsupported(100, 64)
    assert "head size 16" in unsupported(128, 16)
    with pytest.raises(ValueError, match="model.attention=xla"):
        splash_attention(*(jnp.zeros((1, 100, 2, 64)),) * 3, interpret=True)


def test_the_llm_compiles_splash_for_a_tpu_and_counts_its_flops():
    """``auto`` takes splash on a TPU target; the FLOPs XLA cannot see inside the kernel are
    counted from the program. At one 128-block (the causal mask skips none) the kernel does
    XLA attention's 6 products per head (QK^T and PV forward; dP, dS K, dV and dK backward)
    and 3 more: its backward kernels recompute QK^T twice and dO V^T once."""
    sizes = ["model.hidden_size=128", "model.num_heads=2", "model.num_kv_heads=1", "data.seq_len=128"]
    reports = {}
    for attention in ("auto", "xla"):
        report = check_recipe("llm", [*sizes, f"model.attention={attention}"], tpu="v4-8")
        (reports[attention],) = report.tpu
    # The answer says what it is for, the recipe's defaults included, as overrides to copy.
    assert {"data.seq_len=128", "model.preset=tiny", "model.attention=xla", "model.remat=none"} <= set(report.assumed)
    assert report.command.startswith("xlafit check llm --tpu v4-8 model.hidden_size=128 ")
    assert "data.seq_len=128" in report.command and report.command.count("data.seq_len=") == 1
    assert f"  for: {' '.join(report.assumed)}" in report.format()
    splash, xla = reports["auto"], reports["xla"]
    assert splash.fits and xla.fits
    layers, heads, t, d = 2, 2, 128, 64
    recomputed = 3 * 2 * splash.per_device_batch * heads * t * t * d * layers
    assert splash.flops_per_step == pytest.approx(xla.flops_per_step + recomputed, rel=0.01)


def test_kernel_flops_reads_the_calls_in_loops_and_past_their_multiline_configs():
    """A custom call's backend config may span lines, some starting with "}": the calls after
    it still count; one in a ``while`` body counts once per trip."""
    out = "(f32[2,512,128]{2,1,0}, f32[2,4,512,64]{3,2,1,0})"
    config = 'backend_config={{"body":"x\n}}}}, x"}}'  # a line of the config starts with "}"
    call = '%{name} = {out} custom-call(%q), custom_call_target="tpu_custom_call", ' + config
    hlo = "\n".join(
        [
            "%body (p: s32[]) -> s32[] {",
            "  " + call.format(name="splash_mha_dq_no_residuals.1", out=out),
            "  ROOT %p = s32[] parameter(0)",
            "}",
            "%cond (p: s32[]) -> pred[] {",
            "  %p = s32[] parameter(0)",
            "  %c = s32[] constant(3)",
            "  ROOT %lt = pred[] compare(%p, %c), direction=LT",
            "}",
            "ENTRY %main (q: f32[8]) -> f32[8] {",
            "  " + call.format(name="splash_mha_fwd_residuals.1", out=out),
            "  %w = s32[] while(%i), condition=%cond, body=%body",
            "  ROOT %q = f32[8] parameter(0)",
            "}",
        ]
    )
    square = 2 * 2 * 4 * 512 * 512 * 64  # 2 FLOPs per multiply-add, B=2, 4 heads, T=512, D=64
    assert kernel_flops(hlo) == (2 + 3 * 3) * square  # the forward once, dq three times; one 512-block


@pytest.mark.parametrize("packed", [True, False])
def test_splash_runs_per_shard_under_a_steps_mesh(packed):
    """Inside a step the kernel runs per shard (``shard_map``): the batch over ``data`` x
    ``fsdp``, the heads over ``tensor``; unpacked rows pass no segment ids."""
    from xlafit.parallel.mesh import make_mesh
    from xlafit.parallel.sharding import DEFAULT_RULES, activation_layout

    mesh = make_mesh(jax.devices()[:8], data=2, fsdp=2, tensor=2)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(4, 128, 2, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(4, 128, 2, 64)), jnp.float32) for _ in range(2))
    segments = jnp.asarray(np.repeat([[1] * 64 + [2] * 64], 4, axis=0), jnp.int32) if packed else None
    mask = None if segments is None else segments[:, None, :, None] == segments[:, None, None, :]
    with activation_layout(mesh, DEFAULT_RULES, pin=False):
        out = jax.jit(lambda q, k, v: splash_attention(q, k, v, segments, interpret=True))(q, k, v)
    expected = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
    np.testing.assert_allclose(out, expected, atol=1e-5)
