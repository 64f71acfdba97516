"""Checks of xlafit.native.onednn that need a process with one CPU device (the oneDNN path is
off with several): run by tests/test_onednn.py as a script; prints ``ok NAME`` per check."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from xlafit.native import onednn

from xlafit.models.resnet import ResNet, max_pool_3x3_stride2

NHWC = ("NHWC", "HWIO", "NHWC")
rng = np.random.default_rng(0)


def normal(*shape, dtype=np.float32):
    return jnp.asarray(rng.standard_normal(shape).astype(dtype))


def close(a, b, tol=1e-4):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        scale = max(float(jnp.max(jnp.abs(v))), 1.0)
        err = float(jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32))))
        assert err <= tol * scale, f"max error {err} against a scale of {scale}"


def uses_onednn(f, *args, platform="cpu"):
    return "xlafit_onednn" in jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def conv_loss(conv, stride, pads, **options):
    def loss(x, w):
        y = conv(x, w, stride, pads, dimension_numbers=NHWC, **options)
        return jnp.sum(y * jnp.cos(y))  # a cotangent that differs per output

    return loss


def main() -> None:
    """Runs the checks (pytest's doctest collection imports this file: nothing runs then)."""
    status = onednn.status()
    assert status.available, status.reason
    print("ok available", status.reason)

    # The forward pass and both gradients equal XLA's, over strides, kernels, padding and shapes.
    CASES = [
        ((2, 9, 9, 5), (3, 3, 5, 7), (1, 1), ((1, 1), (1, 1))),
        ((2, 9, 9, 5), (3, 3, 5, 7), (2, 2), ((1, 1), (1, 1))),
        ((2, 8, 10, 4), (1, 1, 4, 6), (2, 2), ((0, 0), (0, 0))),
        ((1, 16, 16, 3), (7, 7, 3, 8), (2, 2), ((3, 3), (3, 3))),
        ((3, 7, 6, 4), (3, 2, 4, 5), (1, 2), ((0, 1), (1, 0))),
    ]
    for xs, ws, stride, pads in CASES:
        x, w = normal(*xs), normal(*ws)
        ours = conv_loss(onednn.conv_general_dilated, stride, pads)
        xla = conv_loss(jax.lax.conv_general_dilated, stride, pads)
        assert uses_onednn(ours, x, w), f"{xs} {ws}: not a oneDNN call"
        close(jax.jit(jax.value_and_grad(ours, (0, 1)))(x, w), jax.jit(jax.value_and_grad(xla, (0, 1)))(x, w))
    print("ok conv equals XLA's")

    # bfloat16, where this CPU runs oneDNN's bfloat16 kernels natively: the same passes against
    # XLA's convolution of the same bfloat16 values computed in float32 (one rounding apart).
    if status.bfloat16:
        for xs, ws, stride, pads in CASES:
            x, w = normal(*xs).astype(jnp.bfloat16), normal(*ws).astype(jnp.bfloat16)
            ours = functools.partial(onednn.conv_general_dilated, window_strides=stride, padding=pads,
                                     dimension_numbers=NHWC)  # fmt: skip
            xla = functools.partial(jax.lax.conv_general_dilated, window_strides=stride, padding=pads,
                                    dimension_numbers=NHWC)  # fmt: skip
            assert uses_onednn(ours, x, w), f"bfloat16 {xs} {ws}: not a oneDNN call"
            y, vjp = jax.vjp(ours, x, w)
            g = normal(*y.shape).astype(jnp.bfloat16)
            assert y.dtype == vjp(g)[0].dtype == vjp(g)[1].dtype == jnp.bfloat16
            y_ref, vjp_ref = jax.vjp(xla, x.astype(jnp.float32), w.astype(jnp.float32))
            close((y, *vjp(g)), (y_ref, *vjp_ref(g.astype(jnp.float32))), tol=1e-2)
        print("ok bfloat16 conv equals XLA's")
    # Without native bfloat16 (status.bfloat16 false), XLA's convolution runs for it.
    real_status = onednn.status
    onednn.status = lambda: dataclasses.replace(real_status(), bfloat16=False)
    x16, w16 = normal(2, 9, 9, 4).astype(jnp.bfloat16), normal(3, 3, 4, 4).astype(jnp.bfloat16)
    assert not uses_onednn(conv_loss(onednn.conv_general_dilated, (1, 1), ((1, 1), (1, 1))), x16, w16)
    onednn.status = real_status

    # Where oneDNN does not apply, XLA's convolution runs: same numbers, no custom call.
    x, w = normal(2, 9, 9, 4), normal(3, 3, 4, 4)
    FALLBACKS = {
        "float16": (x.astype(jnp.float16), w.astype(jnp.float16), {}, ((1, 1), (1, 1))),
        "bfloat16 in, float32 out": (
            x.astype(jnp.bfloat16),
            w.astype(jnp.bfloat16),
            {"preferred_element_type": jnp.float32},
            ((1, 1), (1, 1)),
        ),
        "dilation": (x, w, {"rhs_dilation": (2, 2)}, ((1, 1), (1, 1))),
        "groups": (x, w[:, :, :2, :], {"feature_group_count": 2}, ((1, 1), (1, 1))),
        "SAME": (x, w, {}, "SAME"),
    }
    for name, (a, b, options, pads) in FALLBACKS.items():
        ours = conv_loss(onednn.conv_general_dilated, (1, 1), pads, **options)
        assert not uses_onednn(ours, a, b), f"{name}: should be XLA's convolution"
        close(
            jax.grad(ours, (0, 1))(a, b),
            jax.grad(conv_loss(jax.lax.conv_general_dilated, (1, 1), pads, **options), (0, 1))(a, b),
            tol=1e-2,
        )
    print("ok conv falls back")

    # The max-pool and its gradient equal XLA's, ties included (the first maximum wins).
    for shape in [(2, 9, 9, 5), (2, 8, 8, 3), (4, 28, 28, 16)]:
        x = jnp.asarray(rng.integers(0, 3, shape).astype(np.float32))  # many ties
        g = normal(shape[0], (shape[1] + 1) // 2, (shape[2] + 1) // 2, shape[3])

        def pool(x):
            return onednn.max_pool(x, 3, 2, 1, max_pool_3x3_stride2)

        assert uses_onednn(lambda x: pool(x).sum(), x)
        y, vjp = jax.vjp(pool, x)
        y_ref, vjp_ref = jax.vjp(max_pool_3x3_stride2, x)
        np.testing.assert_array_equal(y, y_ref)
        close(vjp(g), vjp_ref(g), tol=1e-6)
        if status.bfloat16:  # the maxima exactly; where windows overlap, sums of two rounded apart
            x16, g16 = x.astype(jnp.bfloat16), g.astype(jnp.bfloat16)
            assert uses_onednn(lambda x: pool(x).sum(), x16)
            y, vjp = jax.vjp(pool, x16)
            y_ref, vjp_ref = jax.vjp(max_pool_3x3_stride2, x16)
            np.testing.assert_array_equal(y, y_ref)
            close(vjp(g16), vjp_ref(g16), tol=1e-2)
    print("ok max-pool equals XLA's")

    # A whole ResNet (7x7 stem and max-pool) in training mode: logits, gradients and batch
    # statistics equal those of the same model with XLA's convolutions.
    images = normal(4, 32, 32, 3)
    labels = jnp.asarray([0, 1, 2, 3])

    def train_grads(conv):
        model = ResNet(18, 10, width=8, conv=conv, rngs=nnx.Rngs(0))
        model.train()
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, images):
            m = nnx.merge(graphdef, params, rest, copy=True)
            logits = m(images)
            return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), labels]), (logits, nnx.state(m, nnx.BatchStat))

        return jax.jit(jax.value_and_grad(loss, has_aux=True)), params

    auto, params = train_grads("auto")
    xla, _ = train_grads("xla")
    assert uses_onednn(auto, params, images), "the ResNet should use oneDNN here"
    assert not uses_onednn(xla, params, images)
    assert not uses_onednn(auto, params, images, platform="tpu"), "a TPU program must not hold the CPU calls"
    close(auto(params, images), xla(params, images), tol=2e-4)
    print("ok resnet equals XLA's")

    # The same in bfloat16 compute (float32 parameters and statistics): the loss agrees to
    # bfloat16's precision.
    if status.bfloat16:
        losses = {}
        for conv in ("auto", "xla"):
            model = ResNet(18, 10, width=8, conv=conv, dtype="bfloat16", rngs=nnx.Rngs(0))
            model.train()
            step = jax.jit(lambda m, x: -jnp.mean(jax.nn.log_softmax(m(x).astype(jnp.float32))[jnp.arange(4), labels]))
            assert uses_onednn(step, model, images) == (conv == "auto")
            losses[conv] = float(step(model, images))
        assert abs(losses["auto"] - losses["xla"]) <= 2e-2 * abs(losses["xla"]), losses
        print("ok bfloat16 resnet equals XLA's", losses)


if __name__ == "__main__":
    main()
