"""The MNIST CNN of pytorch/examples' ``mnist/main.py``, in Flax NNX.

conv 3x3x32 -> relu -> conv 3x3x64 -> relu -> max-pool 2x2 -> dropout 0.25
-> flatten (12*12*64 = 9216) -> dense 128 -> relu -> dropout 0.5 -> dense 10.
All convolutions use VALID padding, as ``nn.Conv2d(..., padding=0)`` does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from xlafit.parallel.sharding import logical

# nnx.Conv's and nnx.Linear's own defaults, named so that logical() can wrap them.
_DEFAULT_KERNEL = nnx.initializers.lecun_normal()
_ZEROS = nnx.initializers.zeros_init()


def max_pool_2x2(x: jax.Array) -> jax.Array:
    """2x2 max pooling with stride 2 over ``[B, H, W, C]`` (H, W even), as reshape + max.

    Same values as ``nnx.max_pool(x, (2, 2), (2, 2))``; its gradient is a broadcast compare
    instead of XLA's select-and-scatter, which is much slower on XLA:CPU, where
    the demos and tests train. Where several inputs of a window tie for the maximum the
    gradient is shared among them; after a ReLU, ties are zeros with zero gradient anyway.
    """
    b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


class MnistCNN(nnx.Module):
    """The pytorch/examples MNIST network.

    Example:
        >>> from flax import nnx
        >>> model = MnistCNN(rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 28, 28, 1))).shape
        (2, 10)
    """

    def __init__(
        self,
        *,
        dropout1: float = 0.25,
        dropout2: float = 0.5,
        dtype: DTypeLike | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        # dtype is the compute dtype ("bfloat16" or jnp.bfloat16); parameters stay float32 (param_dtype default).
        # Logical axes (xlafit.parallel.sharding): FSDP splits output channels and fc1's 9216 inputs.
        conv = lambda cin, cout: nnx.Conv(  # noqa: E731
            cin,
            cout,
            (3, 3),
            padding="VALID",
            dtype=dtype,
            kernel_init=logical(_DEFAULT_KERNEL, "kernel_h", "kernel_w", "conv_in", "conv_out"),
            bias_init=logical(_ZEROS, "conv_out"),
            rngs=rngs,
        )
        dense = lambda din, dout, axes: nnx.Linear(  # noqa: E731
            din,
            dout,
            dtype=dtype,
            kernel_init=logical(_DEFAULT_KERNEL, *axes),
            bias_init=logical(_ZEROS, axes[1]),
            rngs=rngs,
        )
        self.conv1 = conv(1, 32)
        self.conv2 = conv(32, 64)
        self.dropout1 = nnx.Dropout(dropout1, rngs=rngs)
        self.fc1 = dense(12 * 12 * 64, 128, ("embed", "mlp"))
        self.dropout2 = nnx.Dropout(dropout2, rngs=rngs)
        self.fc2 = dense(128, 10, ("mlp", "classes"))

    def __call__(self, images: jax.Array) -> jax.Array:
        """Maps images ``[batch, 28, 28, 1]`` (NHWC, float) to logits ``[batch, 10]``."""
        x = nnx.relu(self.conv1(images))  # (B, 26, 26, 32)
        x = nnx.relu(self.conv2(x))  # (B, 24, 24, 64)
        x = max_pool_2x2(x)  # (B, 12, 12, 64)
        x = self.dropout1(x)
        x = x.reshape(x.shape[0], -1)  # (B, 9216)
        x = nnx.relu(self.fc1(x))
        x = self.dropout2(x)
        return self.fc2(x).astype(jnp.float32)


def train_flops_per_example() -> int:
    """FLOPs (2 per multiply-add) of one training example's forward and backward pass.

    Counts the convolutions and dense layers only, the analytic cross-check of XLA's cost
    analysis: the backward pass costs twice the forward (gradients of inputs and of
    weights), except that conv1 needs no gradient of its input, the image.
    """
    conv1 = 26 * 26 * 32 * (3 * 3 * 1) * 2
    conv2 = 24 * 24 * 64 * (3 * 3 * 32) * 2
    dense = (9216 * 128 + 128 * 10) * 2
    forward = conv1 + conv2 + dense
    return 3 * forward - conv1
