"""ResNet v1.5 (18/34/50/101/152) in Flax NNX, channels-last, laid out as Hugging Face's.

The constructor::

    ResNet(depth: int = 50, num_classes: int = 1000, *, small_stem: bool = False, width: int = 64,
           bn: str = "global", bn_group: int | None = None, dtype=jnp.float32,
           config: ResNetConfig | None = None, rngs: nnx.Rngs)

``model(x)`` maps images ``[B, H, W, C]`` (float32, already normalised) to float32 logits
``[B, num_classes]``. The model is built in eval mode (batch norm uses its running
averages), as the repo's models are; ``model.train()`` / ``model.eval()`` switch. A
:class:`ResNetConfig` describes any Hugging Face ``ResNetConfig`` layout (stage depths,
hidden sizes, basic or bottleneck blocks); ``depth`` and ``width`` are the short way to the
standard ones.

v1.5 (torchvision, MLPerf, ``microsoft/resnet-50``): a bottleneck block downsamples on its
3x3 convolution, not its first 1x1 (Hugging Face's ``downsample_in_bottleneck=False``).
The last batch norm of each block starts with scale 0 (Goyal et al. 2017, section 5.1):
every block starts as the identity. Compute runs in ``dtype`` (``bfloat16`` for mixed
precision) while parameters and batch statistics stay float32; batch-norm statistics are
reduced in float32.

Batch norm under data parallelism (``bn``):
    ``global``: statistics over the whole global batch. The batch axis is sharded over the
    ``data`` mesh axis, so the plain mean over it is the cross-device mean (XLA inserts the
    all-reduce): the same numbers as one device with the whole batch.
    ``local``: statistics per group of ``bn_group`` consecutive examples (Goyal et al. 2017,
    MLPerf's "virtual batch" of 32 per replica); no communication when ``bn_group``
    divides the per-device batch. Running averages take the mean of the groups' statistics.
    Inside ``jit`` the model sees the global batch, so it can only check that ``bn_group``
    divides that: the ``resnet`` recipe checks the per-device batch
    (:func:`xlafit.recipes.resnet.check_bn_group`); other callers must, or a group spans
    devices and XLA adds the communication.

Example:
    >>> from flax import nnx
    >>> parameter_count(nnx.eval_shape(lambda: ResNet(50, 1000, rngs=nnx.Rngs(0))))  # abstract: nothing allocated
    25557032
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from xlafit.parallel.sharding import logical

# Logical axes (xlafit.parallel.sharding) of a convolution kernel: FSDP splits its output channels.
CONV_AXES = ("kernel_h", "kernel_w", "conv_in", "conv_out")

# depth -> (bottleneck blocks?, blocks per stage): He et al. 2016, table 1.
DEPTHS: dict[int, tuple[bool, tuple[int, ...]]] = {
    18: (False, (2, 2, 2, 2)),
    34: (False, (3, 4, 6, 3)),
    50: (True, (3, 4, 6, 3)),
    101: (True, (3, 4, 23, 3)),
    152: (True, (3, 8, 36, 3)),
}
BOTTLENECK_REDUCTION = 4  # a bottleneck's inner width is its output width / 4 (Hugging Face's `reduction`)


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """The architecture, in Hugging Face ``ResNetConfig`` terms, plus xlafit's training options.

    Attributes:
        depths: blocks per stage.
        hidden_sizes: output channels of each stage.
        embedding_size: output channels of the stem.
        bottleneck: bottleneck blocks (1x1, 3x3, 1x1) or basic blocks (3x3, 3x3).
        num_classes: logits.
        num_channels: input image channels.
        small_stem: a 3x3 stride-1 stem convolution and no max-pool (32x32 images, CIFAR);
            the standard stem is a 7x7 stride-2 convolution and a 3x3 stride-2 max-pool.
        downsample_in_first_stage: the first stage downsamples too (Hugging Face's flag).
        downsample_in_bottleneck: stride on the first 1x1 instead of the 3x3 (ResNet v1,
            not v1.5; Hugging Face's flag).
        bn: ``global`` or ``local`` batch statistics in training (see the module docstring).
        bn_group: examples per statistics group for ``bn=local``.
        bn_momentum: running average ``m * running + (1 - m) * batch`` (PyTorch's 0.1 is 0.9 here).
        bn_eps: added to the variance.
        zero_init_residual: the last batch norm of each block starts with scale 0.
        dtype: compute dtype; parameters and batch statistics stay float32.
    """

    depths: tuple[int, ...] = (3, 4, 6, 3)
    hidden_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    embedding_size: int = 64
    bottleneck: bool = True
    num_classes: int = 1000
    num_channels: int = 3
    small_stem: bool = False
    downsample_in_first_stage: bool = False
    downsample_in_bottleneck: bool = False
    bn: Literal["global", "local"] = "global"
    bn_group: int | None = None
    bn_momentum: float = 0.9
    bn_eps: float = 1e-5
    zero_init_residual: bool = True
    dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        if len(self.depths) != len(self.hidden_sizes) or not self.depths:
            raise ValueError(
                f"depths {self.depths} and hidden_sizes {self.hidden_sizes} must name the same, non-zero number "
                "of stages."
            )
        if min(self.depths) < 1 or min(self.hidden_sizes) < 1 or self.embedding_size < 1 or self.num_classes < 1:
            raise ValueError("every depth, hidden size, the embedding size and num_classes must be positive.")
        if self.bn not in ("global", "local"):
            raise ValueError(f"bn={self.bn!r}: use 'global' (whole-batch statistics) or 'local' (per group).")
        if self.bn == "local" and (self.bn_group is None or self.bn_group < 1):
            raise ValueError("bn='local' needs bn_group, the examples per statistics group (e.g. 32).")
        if self.bn == "global" and self.bn_group is not None:
            raise ValueError(f"bn_group={self.bn_group} is only used with bn='local'; set bn='local' or drop it.")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}: use 'float32' or 'bfloat16'.")

    @classmethod
    def for_depth(cls, depth: int, num_classes: int = 1000, *, width: int = 64, **options) -> ResNetConfig:
        """The standard ResNet-``depth`` with stem width ``width`` (64 in the paper).

        Example:
            >>> ResNetConfig.for_depth(18, 10, width=16).hidden_sizes
            (16, 32, 64, 128)
        """
        if depth not in DEPTHS:
            raise ValueError(f"ResNet depth {depth} is not one of {sorted(DEPTHS)}.")
        if width < 1:
            raise ValueError(f"width={width} must be positive (64 is the standard ResNet).")
        bottleneck, depths = DEPTHS[depth]
        factor = BOTTLENECK_REDUCTION if bottleneck else 1
        hidden = tuple(width * factor * 2**i for i in range(len(depths)))
        return cls(depths, hidden, width, bottleneck, num_classes, **options)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(jnp.bfloat16 if self.dtype == "bfloat16" else jnp.float32)


def _dtype_name(dtype: DTypeLike | str | None) -> Literal["float32", "bfloat16"]:
    name = jnp.dtype(dtype or jnp.float32).name
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: ResNet computes in float32 or bfloat16.")
    return "bfloat16" if name == "bfloat16" else "float32"


def _channels(x: jax.Array, c: jax.Array) -> jax.Array:
    """A per-channel vector ``[C]`` shaped to broadcast against ``x`` (channels last)."""
    return c.reshape((1,) * (x.ndim - 1) + c.shape)


def _normalise(
    x: jax.Array,
    mean: jax.Array,
    var: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    residual: jax.Array | None,
    eps: float,
    relu: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Float32 ``relu(a * x + b [+ residual])`` with ``a = scale / sqrt(var + eps)`` and ``b = bias -
    mean * a`` per channel (``mean``/``var`` broadcast against ``x``): ``(out, rsqrt(var + eps), a)``."""
    xf = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(var + eps)
    a = _channels(xf, scale) * rstd
    y = xf * a + (_channels(xf, bias) - mean * a)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    if relu:
        y = jnp.maximum(y, 0.0)
    return y, rstd, a


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def batch_norm_train(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    residual: jax.Array | None,
    axes: tuple[int, ...],
    eps: float,
    relu: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Batch norm of ``x`` with its statistics over ``axes``, plus ``residual`` if given, then ReLU
    if ``relu``: ``(out, mean, var)``. ``out`` has ``x``'s dtype (as ``residual`` must); the
    arithmetic and the statistics (with size-1 dimensions) are float32.

    A custom VJP with the closed-form gradient (Ioffe & Szegedy 2015, section 3) instead of
    autodiff through the statistics: what the backward pass keeps is ``x`` and ``out`` in
    ``x``'s dtype (bfloat16 under mixed precision) and per-channel vectors; ReLU's gradient is
    read off ``out``, so the float32 sum before the ReLU is never stored. Autodiff through the
    formula keeps four float32 tensors of ``x``'s size (four times the bytes under
    bfloat16, twice under float32): the activation memory a ResNet trains with, on any device.
    ``mean`` and ``var`` feed the running averages; their cotangents are ignored.

    Example:
        >>> x = jnp.arange(8.0).reshape(2, 1, 2, 2)
        >>> out, mean, var = batch_norm_train(x, jnp.ones(2), jnp.zeros(2), None, (0, 1, 2), 1e-5, True)
        >>> mean.ravel().tolist(), out.shape
        ([3.0, 4.0], (2, 1, 2, 2))
    """
    return _bn_forward(x, scale, bias, residual, axes, eps, relu)[0]


def _bn_forward(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    residual: jax.Array | None,
    axes: tuple[int, ...],
    eps: float,
    relu: bool,
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], tuple[Any, ...]]:
    xf = x.astype(jnp.float32)
    mean = xf.mean(axes, keepdims=True)
    var = jnp.maximum((xf * xf).mean(axes, keepdims=True) - mean * mean, 0.0)  # biased, as Flax's
    y, rstd, a = _normalise(xf, mean, var, scale, bias, residual, eps, relu)
    out = y.astype(x.dtype)
    # x and out are kept for the backward pass in x's dtype (bfloat16 under mixed precision)
    return (out, mean, var), (x, out, mean, rstd, a, residual is not None)


def _bn_backward(
    axes: tuple[int, ...], eps: float, relu: bool, saved: tuple[Any, ...], cotangents: tuple[jax.Array, ...]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    x_saved, out, mean, rstd, a, has_residual = saved
    x = x_saved.astype(jnp.float32)
    dout = cotangents[0].astype(jnp.float32)
    dy = jnp.where(out > 0, dout, 0.0) if relu else dout
    n = math.prod(x.shape[i] for i in axes)
    sum_dy = dy.sum(axes, keepdims=True)
    # sum(dy * xhat), xhat = (x - mean) * rstd, from one pass over dy * x
    sum_dy_xhat = rstd * ((dy * x).sum(axes, keepdims=True) - mean * sum_dy)
    # dx = a * (dy - mean(dy) - xhat * mean(dy * xhat)) = dy * a + x * c1 + c0
    c1 = -a * rstd * sum_dy_xhat / n
    c0 = -a * sum_dy / n - c1 * mean
    dx = dy * a + x * c1 + c0
    channels = x.shape[-1]
    d_scale = sum_dy_xhat.reshape(-1, channels).sum(0)  # summed over groups
    d_bias = sum_dy.reshape(-1, channels).sum(0)
    return dx.astype(x_saved.dtype), d_scale, d_bias, dy.astype(x_saved.dtype) if has_residual else None


batch_norm_train.defvjp(_bn_forward, _bn_backward)


class BatchNorm(nnx.Module):
    """Batch norm over ``[B, H, W, C]`` with global or per-group statistics.

    Training (``use_running_average=False``) normalises with the statistics of the batch
    (``group=None``) or of each group of ``group`` consecutive examples, and updates the
    running averages (``nnx.BatchStat``, float32) with their mean; evaluation uses the
    running averages. The statistics are ``E[x]`` and ``E[x^2] - E[x]^2`` in float32 (one
    pass over the activations, as Flax's ``use_fast_variance``; it loses the variance when a
    channel's mean is about 1,000 times its spread or more, which batch-normalised
    activations do not reach); the running variance is
    the biased one, as Flax's (PyTorch keeps the unbiased, a factor n / (n - 1) apart).
    ``norm(x, residual, relu=True)`` adds ``residual`` after normalising and applies ReLU,
    in the same passes (:func:`batch_norm_train`).
    """

    def __init__(
        self,
        features: int,
        *,
        group: int | None = None,
        momentum: float = 0.9,
        eps: float = 1e-5,
        zero_scale: bool = False,
        dtype: DTypeLike = jnp.float32,
    ) -> None:
        norm = logical(lambda key, shape, value: jnp.full(shape, value, jnp.float32), "norm")  # logical axes
        self.scale = nnx.Param(norm(None, (features,), 0.0 if zero_scale else 1.0))
        self.bias = nnx.Param(norm(None, (features,), 0.0))
        self.mean = nnx.BatchStat(norm(None, (features,), 0.0))
        self.var = nnx.BatchStat(norm(None, (features,), 1.0))
        self.group = group
        self.momentum = momentum
        self.eps = eps
        self.dtype = dtype
        self.use_running_average = True

    def __call__(self, x: jax.Array, residual: jax.Array | None = None, *, relu: bool = False) -> jax.Array:
        if self.use_running_average:
            mean, var = _channels(x, self.mean[...]), _channels(x, self.var[...])
            y = _normalise(x, mean, var, self.scale[...], self.bias[...], residual, self.eps, relu)[0]
            return y.astype(self.dtype)
        b = x.shape[0]
        values = (self.group or b) * x.shape[1] * x.shape[2]
        if values == 1:  # PyTorch refuses this too ("Expected more than 1 value per channel")
            raise ValueError(
                f"batch norm over one value per channel (groups of {self.group or b} example(s) at "
                f"{x.shape[1]}x{x.shape[2]}) sets every output to the bias, whatever the input; use a larger "
                "batch (or model.bn_group), larger images, or model.small_stem=true for small images."
            )
        if self.group is not None:
            if b % self.group:
                raise ValueError(
                    f"batch norm groups of {self.group} examples do not divide the batch of {b}; make "
                    "model.bn_group divide the per-device batch."
                )
            # [B, H, W, C] -> [B / g, g, H, W, C]: with g dividing the per-device batch every group
            # lives on one device, so its statistics need no communication.
            x = x.reshape(b // self.group, self.group, *x.shape[1:])
            residual = None if residual is None else residual.reshape(x.shape)
        residual = None if residual is None else residual.astype(x.dtype)
        axes = tuple(range(x.ndim - 4, x.ndim - 1))  # (batch or group, H, W)
        y, mean, var = batch_norm_train(x, self.scale[...], self.bias[...], residual, axes, self.eps, relu)
        m = self.momentum
        # Running averages: the mean over groups of the group statistics (the batch's, for global).
        batch_mean = mean.reshape(-1, x.shape[-1]).mean(0)
        batch_var = var.reshape(-1, x.shape[-1]).mean(0)
        self.mean.set_value(m * self.mean[...] + (1 - m) * jax.lax.stop_gradient(batch_mean))
        self.var.set_value(m * self.var[...] + (1 - m) * jax.lax.stop_gradient(batch_var))
        return y.reshape(b, *x.shape[-3:]).astype(self.dtype)


class ConvBN(nnx.Module):
    """A bias-free convolution with PyTorch's symmetric padding, then batch norm.

    Hugging Face's ``ResNetConvLayer`` without its activation. The padding is ``k // 2`` on
    every side (PyTorch's ``padding=k // 2``), not XLA's ``SAME``, which pads a stride-2
    convolution of an even size on one side only and would shift every feature map.
    """

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int,
        stride: int,
        cfg: ResNetConfig,
        *,
        zero_scale: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        pad = kernel // 2
        self.conv = nnx.Conv(
            cin,
            cout,
            (kernel, kernel),
            strides=(stride, stride),
            padding=((pad, pad), (pad, pad)),
            use_bias=False,
            dtype=cfg.compute_dtype,
            # He et al. 2015 with fan_out, as torchvision and Hugging Face initialise ResNets.
            kernel_init=logical(nnx.initializers.variance_scaling(2.0, "fan_out", "normal"), *CONV_AXES),
            rngs=rngs,
        )
        self.norm = BatchNorm(
            cout,
            group=cfg.bn_group if cfg.bn == "local" else None,
            momentum=cfg.bn_momentum,
            eps=cfg.bn_eps,
            zero_scale=zero_scale,
            dtype=cfg.compute_dtype,
        )

    def __call__(self, x: jax.Array, residual: jax.Array | None = None, *, relu: bool = False) -> jax.Array:
        """``norm(conv(x)) [+ residual]``, then ReLU if ``relu``."""
        return self.norm(self.conv(x), residual, relu=relu)


class Block(nnx.Module):
    """A residual block: basic (3x3, 3x3) or bottleneck (1x1, 3x3, 1x1), and a projection
    shortcut (1x1 conv + batch norm) where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int, cfg: ResNetConfig, rngs: nnx.Rngs) -> None:
        zero = cfg.zero_init_residual
        if cfg.bottleneck:
            mid = cout // BOTTLENECK_REDUCTION
            first, second = (stride, 1) if cfg.downsample_in_bottleneck else (1, stride)
            convs = [
                ConvBN(cin, mid, 1, first, cfg, rngs=rngs),
                ConvBN(mid, mid, 3, second, cfg, rngs=rngs),
                ConvBN(mid, cout, 1, 1, cfg, zero_scale=zero, rngs=rngs),
            ]
        else:
            convs = [
                ConvBN(cin, cout, 3, stride, cfg, rngs=rngs),
                ConvBN(cout, cout, 3, 1, cfg, zero_scale=zero, rngs=rngs),
            ]
        self.convs = nnx.List(convs)
        self.shortcut = ConvBN(cin, cout, 1, stride, cfg, rngs=rngs) if cin != cout or stride != 1 else None

    def __call__(self, x: jax.Array) -> jax.Array:
        residual = self.shortcut(x) if self.shortcut is not None else x
        y = x
        for conv in self.convs[:-1]:
            y = conv(y, relu=True)
        return self.convs[-1](y, residual, relu=True)  # relu(norm(conv(y)) + residual)


def max_pool_3x3_stride2(x: jax.Array) -> jax.Array:
    """PyTorch's ``MaxPool2d(3, stride=2, padding=1)`` over ``[B, H, W, C]`` (padding never wins).

    The padding is explicit: ``SAME`` pads an even size on one side only. The gradient (XLA's
    select-and-scatter) sends each output's gradient to the first maximum of its window, as
    PyTorch does.
    """
    return nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))


def classifier(cfg: ResNetConfig, rngs: nnx.Rngs) -> nnx.Linear:
    """The classifier over the pooled features of the last stage."""
    return nnx.Linear(
        cfg.hidden_sizes[-1],
        cfg.num_classes,
        dtype=cfg.compute_dtype,
        # PyTorch's nn.Linear default (kaiming_uniform with a=sqrt(5)): U(+-1/sqrt(fan_in)).
        kernel_init=logical(nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform"), "embed", "classes"),
        bias_init=logical(nnx.initializers.zeros_init(), "classes"),
        rngs=rngs,
    )


class ResNet(nnx.Module):
    """ResNet v1.5 image classifier; see the module docstring for the arguments.

    Example (one basic block on 32x32 images; ``ResNet(18, 10, small_stem=True, width=16)`` is the demo's):
        >>> from flax import nnx
        >>> cfg = ResNetConfig((1,), (8,), 8, bottleneck=False, num_classes=10, small_stem=True, bn="local", bn_group=2)
        >>> model = ResNet(config=cfg, rngs=nnx.Rngs(0))
        >>> model.train()
        >>> model(jnp.ones((4, 32, 32, 3))).shape
        (4, 10)
    """

    def __init__(
        self,
        depth: int = 50,
        num_classes: int = 1000,
        *,
        small_stem: bool = False,
        width: int = 64,
        bn: Literal["global", "local"] = "global",
        bn_group: int | None = None,
        dtype: DTypeLike | str = jnp.float32,
        config: ResNetConfig | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        if config is None:
            config = ResNetConfig.for_depth(
                depth,
                num_classes,
                width=width,
                small_stem=small_stem,
                bn=bn,
                bn_group=bn_group,
                dtype=_dtype_name(dtype),
            )
        cfg = self.cfg = config
        kernel, stride = (3, 1) if cfg.small_stem else (7, 2)
        self.stem = ConvBN(cfg.num_channels, cfg.embedding_size, kernel, stride, cfg, rngs=rngs)
        stages, cin = [], cfg.embedding_size
        for i, (blocks, cout) in enumerate(zip(cfg.depths, cfg.hidden_sizes, strict=True)):
            stride = 2 if i > 0 or cfg.downsample_in_first_stage else 1
            stage = [Block(cin, cout, stride, cfg, rngs)] + [Block(cout, cout, 1, cfg, rngs) for _ in range(blocks - 1)]
            stages.append(nnx.List(stage))
            cin = cout
        self.stages = nnx.List(stages)
        self.head = classifier(cfg, rngs)
        self.eval()

    def __call__(self, images: jax.Array) -> jax.Array:
        """Images ``[B, H, W, C]`` (normalised) -> float32 logits ``[B, num_classes]``."""
        x = self.stem(images.astype(self.cfg.compute_dtype), relu=True)
        if not self.cfg.small_stem:
            x = max_pool_3x3_stride2(x)
        for stage in self.stages:
            for block in stage:
                x = block(x)
        x = x.astype(jnp.float32).mean(axis=(1, 2))  # global average pool, (B, C)
        return self.head(x).astype(jnp.float32)


def parameter_count(model: nnx.Module) -> int:
    """Trainable parameters (``nnx.Param``), not batch statistics: 25,557,032 for ResNet-50."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def train_flops_per_example(cfg: ResNetConfig, image_size: int = 224) -> float:
    """FLOPs (2 per multiply-add) to train on one ``image_size`` square image: forward and backward.

    Convolutions and the classifier only (batch norm, ReLU and pooling are a rounding error).
    The backward pass is twice the forward (input and weight gradients), less the stem's
    input gradient, which nothing needs: 24.3 GFLOP for ResNet-50 at 224 px (3 x 4.09 GMAC x 2,
    less 0.24 GFLOP; the ~24.5 often quoted is the plain 3 x forward).

    Example:
        >>> round(train_flops_per_example(ResNetConfig.for_depth(50)) / 1e9, 1)
        24.3
    """
    size = image_size

    def conv(cin: int, cout: int, k: int, stride: int) -> int:
        nonlocal size
        size = (size + 2 * (k // 2) - k) // stride + 1
        return 2 * size * size * cout * cin * k * k

    kernel, stride = (3, 1) if cfg.small_stem else (7, 2)
    stem = conv(cfg.num_channels, cfg.embedding_size, kernel, stride)
    if not cfg.small_stem:
        size = (size - 1) // 2 + 1
    forward, cin = stem, cfg.embedding_size
    for i, (blocks, cout) in enumerate(zip(cfg.depths, cfg.hidden_sizes, strict=True)):
        for j in range(blocks):
            stride = 2 if j == 0 and (i > 0 or cfg.downsample_in_first_stage) else 1
            start = size
            if cin != cout or stride != 1:
                forward += conv(cin, cout, 1, stride)
                size = start
            if cfg.bottleneck:
                mid = cout // BOTTLENECK_REDUCTION
                first, second = (stride, 1) if cfg.downsample_in_bottleneck else (1, stride)
                forward += conv(cin, mid, 1, first) + conv(mid, mid, 3, second) + conv(mid, cout, 1, 1)
            else:
                forward += conv(cin, cout, 3, stride) + conv(cout, cout, 3, 1)
            cin = cout
    forward += 2 * cin * cfg.num_classes
    return float(3 * forward - stem)
