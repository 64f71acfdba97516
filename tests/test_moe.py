"""The mixture-of-experts pieces (xlafit.models.moe): the tiled grouped product equals
jax.lax.ragged_dot (values and gradients), grouped products equal every expert computing
every token, and the router is Qwen3-MoE's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlafit.models.moe import dense_experts, ragged_experts, route, tiled_ragged_dot

# Groups of 0, 1, more than a tile, and the rest; 5 rows past the groups (ragged_dot's zeros).
SIZES = [0, 1, 40, 3, 0, 19, 2, 0]


def _operands(rows: int = 70):
    keys = jax.random.split(jax.random.key(0), 2)
    lhs = jax.random.normal(keys[0], (rows, 12))
    rhs = jax.random.normal(keys[1], (len(SIZES), 12, 6))
    return lhs, rhs, jnp.array(SIZES, jnp.int32)


def test_the_tiled_grouped_product_equals_ragged_dot():
    lhs, rhs, sizes = _operands()
    np.testing.assert_allclose(
        np.asarray(tiled_ragged_dot(lhs, rhs, sizes)), np.asarray(jax.lax.ragged_dot(lhs, rhs, sizes)), atol=1e-5
    )


def test_the_tiled_grouped_product_has_ragged_dots_gradients():
    lhs, rhs, sizes = _operands()
    probe = jax.random.normal(jax.random.key(3), (lhs.shape[0], rhs.shape[2]))

    def loss(f):
        return lambda a, b: jnp.sum(f(a, b, sizes) * probe)

    ours = jax.grad(loss(tiled_ragged_dot), argnums=(0, 1))(lhs, rhs)
    theirs = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("norm", [False, True])
def test_grouped_experts_equal_every_expert_on_every_token(norm):
    keys = jax.random.split(jax.random.key(1), 5)
    n, d, f, e, k = 33, 16, 8, 8, 2
    x = jax.random.normal(keys[0], (n, d))
    weights, experts, _ = route(jax.random.normal(keys[1], (n, e)), k, norm)
    gate, up = (jax.random.normal(keys[i], (e, d, f)) * 0.3 for i in (2, 3))
    down = jax.random.normal(keys[4], (e, f, d)) * 0.3

    def run(impl):
        return impl(x, weights, experts, gate, up, down, "silu")

    np.testing.assert_allclose(np.asarray(run(ragged_experts)), np.asarray(run(dense_experts)), atol=1e-5)
    grads = [jax.grad(lambda g, impl=impl: jnp.sum(impl(x, weights, experts, g, up, down, "silu") ** 2))(gate)
             for impl in (ragged_experts, dense_experts)]  # fmt: skip
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(grads[1]), atol=1e-4)


@pytest.mark.parametrize("norm", [False, True])
def test_the_router_is_qwen3_moes(norm):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(config)
    torch.manual_seed(0)
    router.weight.data.normal_()
    x = np.random.default_rng(0).normal(size=(10, 16)).astype(np.float32)
    with torch.no_grad():
        logits, scores, indices = router(torch.tensor(x))
    weights, experts, _ = route(jnp.asarray(logits.numpy()), 3, norm)
    np.testing.assert_array_equal(np.asarray(experts), indices.numpy())
    np.testing.assert_allclose(np.asarray(weights), scores.numpy(), atol=1e-6)


# --------------------------------------------------------------------------- the step model

# jax.lax.ragged_dot(a, b, g) and its weight gradient as a v5e compiles them (libtpu): the
# forward a Mosaic kernel after one that turns the group sizes into tile offsets; 1024 routed
# rows of 256 features into 8 experts of 512.
TPU_RAGGED_DOT = """
ENTRY %main.1 (a.1: bf16[1024,256], b.1: bf16[8,256,512], g.1: s32[8]) -> bf16[1024,512] {
  %g.1 = s32[8]{0:T(128)} parameter(2)
  %b.1 = bf16[8,256,512]{2,1,0:T(8,128)(2,1)} parameter(1)
  %a.1 = bf16[1024,256]{1,0:T(8,128)(2,1)} parameter(0)
  %ragged-dot-metadata = (s32[9]{0:T(128)S(1)}, s32[15]{0:T(128)S(1)}, s32[15]{0:T(128)S(1)}, s32[1]{0:T(128)}) custom-call(%g.1), custom_call_target="tpu_custom_call"
  %get-tuple-element = s32[1]{0:T(128)} get-tuple-element(%ragged-dot-metadata), index=3
  %get-tuple-element.3 = s32[15]{0:T(128)S(1)} get-tuple-element(%ragged-dot-metadata), index=2
  %get-tuple-element.2 = s32[15]{0:T(128)S(1)} get-tuple-element(%ragged-dot-metadata), index=1
  %get-tuple-element.1 = s32[9]{0:T(128)S(1)} get-tuple-element(%ragged-dot-metadata), index=0
  ROOT %ragged-dot-none = bf16[1024,512]{1,0:T(8,128)(2,1)} custom-call(%get-tuple-element, %get-tuple-element.1, %get-tuple-element.2, %get-tuple-element.3, %get-tuple-element, /*index=5*/%a.1, %b.1), custom_call_target="tpu_custom_call"
}
"""  # noqa: E501


def test_the_step_model_prices_a_grouped_product_by_its_routed_rows():
    from xlafit.predict.ops import kernels

    (product,) = [k for k in kernels(TPU_RAGGED_DOT) if k.name == "ragged-dot-none"]
    assert product.kind == "matmul"
    assert product.flops == 2 * 1024 * 512 * 256  # each routed row times its own expert, not all 8
    assert product.shape == (1, 1024, 512, 256)


def test_a_ragged_dot_instruction_counts_each_row_once():
    """The HLO op itself (before a backend rewrites it): forward, and the weight gradient
    whose contraction runs over the ragged rows."""
    from xlafit.predict.hlo import product_flops

    shapes = {"a": "f32[1024,256]{1,0}", "b": "f32[8,256,512]{2,1,0}", "g": "s32[8]{0}", "d": "f32[1024,512]{1,0}"}
    forward = (
        "(%a, %b, %g), lhs_contracting_dims={1}, rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}"
    )
    assert product_flops("ragged-dot", "f32[1024,512]{1,0}", forward, shapes) == 2 * 1024 * 512 * 256
    weights = "(%a, %d, %g), lhs_contracting_dims={0}, rhs_contracting_dims={0}, lhs_ragged_dims={0}"
    assert product_flops("ragged-dot", "f32[8,256,512]{2,1,0}", weights, shapes) == 2 * 1024 * 512 * 256
