"""Activations with derivative rules of their own (xlafit.models.activations): the same
values and derivatives as the plain functions, and fewer arrays kept for the backward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlafit.models.activations import gated, gelu

X = jnp.linspace(-6.0, 6.0, 1001, dtype=jnp.float32)


def kept(f, *shapes):
    """How many arrays of the inputs' shape the forward pass keeps for the backward."""
    args = [jnp.ones(shapes[0], jnp.bfloat16) for _ in shapes]
    _, backward = jax.vjp(f, *args)
    return sum(getattr(leaf, "shape", None) == shapes[0] for leaf in jax.tree_util.tree_leaves(backward))


def test_gelu_is_the_exact_one_and_keeps_one_array_for_its_backward():
    exact = functools.partial(jax.nn.gelu, approximate=False)
    np.testing.assert_allclose(gelu(X), exact(X), atol=2e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(gelu))(X), jax.vmap(jax.grad(exact))(X), atol=1e-6)
    np.testing.assert_allclose(jax.grad(jax.grad(gelu))(0.3), jax.grad(jax.grad(exact))(0.3), rtol=1e-6)
    assert (kept(gelu, (8, 16)), kept(exact, (8, 16))) == (1, 3)


@pytest.mark.parametrize(
    ("activation", "plain", "plain_kept"),
    [("silu", jax.nn.silu, 5), ("gelu_tanh", functools.partial(jax.nn.gelu, approximate=True), 7)],
)
def test_a_gated_product_is_act_times_up_and_keeps_two_arrays(activation, plain, plain_kept):
    up = jnp.cos(X)
    ours = functools.partial(gated, activation=activation)

    def reference(g, u):
        return plain(g) * u

    np.testing.assert_allclose(ours(X, up), reference(X, up), atol=1e-6)
    for a, b in zip(jax.vmap(jax.grad(ours, (0, 1)))(X, up), jax.vmap(jax.grad(reference, (0, 1)))(X, up), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)
    hessian = jax.hessian(lambda g: ours(g, 0.7))(0.3), jax.hessian(lambda g: reference(g, 0.7))(0.3)
    np.testing.assert_allclose(*hessian, rtol=1e-5)
    assert (kept(ours, (8, 16), (8, 16)), kept(reference, (8, 16), (8, 16))) == (2, plain_kept)
    # bfloat16 in, bfloat16 out, rounded once
    assert ours(X.astype(jnp.bfloat16), up.astype(jnp.bfloat16)).dtype == jnp.bfloat16
