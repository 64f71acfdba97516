"""The losses of train/losses.py: the blockwise cross-entropy equals the whole computation,
and never holds the whole logits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from xlafit.train.losses import (
    BLOCK_BYTES,
    LANES,
    blocks_for,
    blockwise_cross_entropy,
    masked_accuracy,
    masked_mean,
)

B, T, H, V = 3, 29, 16, 203  # T and V prime: no chunk or tile divides them


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(H, V)) * 0.5, jnp.float32)
    labels = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    weights = (rng.random((B, T)) > 0.3).astype(np.float32)
    weights[1, 20:] = 0  # a padded tail
    weights[2] = 0  # a row of padding only
    labels = labels.at[0, :4].set(V - 1)  # labels in the last tile's columns
    return hidden, kernel, labels, jnp.asarray(weights)


def _whole(hidden, kernel, labels, weights, softcap):
    logits = hidden @ kernel
    if softcap:
        logits = jnp.tanh(logits / softcap) * softcap
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return masked_mean(losses, weights), masked_accuracy(logits, labels, weights)


def _value_and_grads(loss_fn, hidden, kernel):
    """Loss, accuracy and the gradients of a per-row weighted sum (rows weigh 1, 2, 3: the
    per-row cotangents differ)."""

    def total(h, k):
        loss, accuracy = loss_fn(h, k)
        return (loss * jnp.arange(1.0, B + 1)).sum(), (loss, accuracy)

    (_, (loss, accuracy)), grads = jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))(hidden, kernel)
    return loss, accuracy, grads


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize(
    "chunk, tile",
    [(5, None), (T, None), (64, None), (8, 64), (7, 128), (T, 50), (1, V), (4, LANES)],
)  # positions only; one chunk of the vocabulary tiles; both; tiles whose last one overlaps the one before
def test_the_blockwise_loss_is_the_whole_loss_and_its_gradients(chunk, tile, softcap):
    hidden, kernel, labels, weights = _inputs()
    whole = _value_and_grads(lambda h, k: _whole(h, k, labels, weights, softcap), hidden, kernel)
    blocks = _value_and_grads(
        lambda h, k: blockwise_cross_entropy(h, k, labels, weights, chunk=chunk, tile=tile, softcap=softcap),
        hidden,
        kernel,
    )
    (loss0, acc0, (dh0, dk0)), (loss1, acc1, (dh1, dk1)) = whole, blocks
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    np.testing.assert_array_equal(acc1, acc0)
    assert float(loss1[2]) == 0.0 and float(acc1[2]) == 0.0  # a row of padding only
    for got, want in ((dh1, dh0), (dk1, dk0)):  # float32 sums in another order: 1e-6 of the largest
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(jnp.abs(want).max()))
    assert float(jnp.abs(dh1[2]).max()) == 0.0  # padding gets no gradient


def test_ties_go_to_the_first_column_as_argmax_does():
    hidden = jnp.ones((1, 2, 4))
    kernel = jnp.ones((4, 300))  # every logit equal: the arg-max is column 0
    labels = jnp.asarray([[0, 299]], jnp.int32)
    blockwise = jax.jit(lambda h, k: blockwise_cross_entropy(h, k, labels, jnp.ones((1, 2)), chunk=1, tile=128))
    _, accuracy = blockwise(hidden, kernel)
    assert float(accuracy[0]) == 0.5


def _largest_array(jaxpr):
    """The most elements of any value a program (and the programs inside its loops) makes."""
    most = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            most = max(most, int(np.prod(getattr(var.aval, "shape", ()))))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                most = max(most, _largest_array(inner))
    return most


def test_no_value_of_the_blockwise_loss_or_its_gradient_is_as_large_as_the_logits():
    """The forward and backward programs hold blocks [B, chunk, tile], never [B, T, V]."""
    hidden, kernel, labels, weights = _inputs()

    def loss(h, k):
        return blockwise_cross_entropy(h, k, labels, weights, chunk=8, tile=64)[0].sum()

    program = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(hidden, kernel).jaxpr
    assert _largest_array(program) == max(B * 8 * 64, H * V)  # a block, or the kernel and its gradient
    whole = jax.make_jaxpr(jax.grad(lambda h, k: _whole(h, k, labels, weights, None)[0].sum(), argnums=(0, 1)))
    assert _largest_array(whole(hidden, kernel).jaxpr) >= B * T * V  # what the test would catch


@pytest.mark.parametrize(
    "rows, seq_len, vocab, chunk",
    [(1, 8192, 262144, None), (2, 8192, 128256, None), (8, 256, 2000, None), (3, 8192, 128256, 1024), (16, 100, 50, 7)],
)
def test_blocks_hold_a_bounded_share_of_the_logits(rows, seq_len, vocab, chunk):
    got_chunk, tile = blocks_for(rows, seq_len, vocab, chunk)
    assert got_chunk == min(chunk or max(1, 4096 // rows), seq_len)
    tiles = -(-vocab // tile)
    assert tiles * tile >= vocab and (tile == vocab or tile % LANES == 0)
    assert rows * got_chunk * tile * 4 <= BLOCK_BYTES + rows * got_chunk * LANES * 4  # within a lane's rounding
    assert (tile < vocab) == (rows * got_chunk * vocab * 4 > BLOCK_BYTES)  # tiled only where a block is large
