"""Where XLA:CPU loses to PyTorch's oneDNN on ResNet-50: one convolution at a time.

    python benchmarks/resnet_conv_layers.py [BATCH] [REPEATS] [all]

For representative ResNet-50 convolutions (batch 8, 224 px images, NHWC / channels-last,
float32), the milliseconds of the forward pass, the input gradient and the weight gradient,
each on its own: XLA (a jitted ``lax.conv_general_dilated`` and its VJPs, with the YNNPACK
paths ``xlafit.connect()`` sets on CPU) against PyTorch eager (``F.conv2d``, and each
gradient alone through autograd: the oneDNN kernels ``loss.backward()`` runs).
The last column: the same passes as xlafit's oneDNN FFI calls (:mod:`xlafit.native.onednn`,
what a ResNet on one CPU device runs since the ninth session). Also the 1x1 weight gradient
written as a plain matmul (``x.T @ g``), to tell the GEMM from the convolution emitter.
Medians of REPEATS calls after one warm-up.

With ``all``: every distinct convolution of ResNet-50 (the stem, the strided shortcuts), each
counted as often as the network has it, so that the totals cover all of a step's
convolutions (the stem's input gradient is left out: training does not need it).
The totals understate a step's oneDNN convolution time: in a step the inputs come from
memory rather than cache, and XLA's own threads share the cores (BENCHMARKS.md).
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from xlafit.native import onednn

import xlafit

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 8
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 10
# (height = width of the input, in channels, out channels, kernel, stride): ResNet-50's stages.
LAYERS = [
    (56, 64, 64, 3, 1),
    (56, 256, 64, 1, 1),
    (56, 64, 256, 1, 1),
    (56, 128, 128, 3, 2),
    (28, 128, 128, 3, 1),
    (28, 512, 128, 1, 1),
    (14, 256, 256, 3, 1),
    (14, 1024, 256, 1, 1),
    (7, 512, 512, 3, 1),
    (7, 2048, 512, 1, 1),
]
# (layer, how many ResNet-50 has): every distinct convolution, for ``all``.
ALL_LAYERS = [
    ((224, 3, 64, 7, 2), 1),
    ((56, 64, 64, 1, 1), 1),
    ((56, 64, 64, 3, 1), 3),
    ((56, 64, 256, 1, 1), 4),
    ((56, 256, 64, 1, 1), 2),
    ((56, 256, 128, 1, 1), 1),
    ((56, 128, 128, 3, 2), 1),
    ((56, 256, 512, 1, 2), 1),
    ((28, 128, 512, 1, 1), 4),
    ((28, 512, 128, 1, 1), 3),
    ((28, 128, 128, 3, 1), 3),
    ((28, 512, 256, 1, 1), 1),
    ((28, 256, 256, 3, 2), 1),
    ((28, 512, 1024, 1, 2), 1),
    ((14, 256, 1024, 1, 1), 6),
    ((14, 1024, 256, 1, 1), 5),
    ((14, 256, 256, 3, 1), 5),
    ((14, 1024, 512, 1, 1), 1),
    ((14, 512, 512, 3, 2), 1),
    ((14, 1024, 2048, 1, 2), 1),
    ((7, 512, 2048, 1, 1), 3),
    ((7, 2048, 512, 1, 1), 2),
    ((7, 512, 512, 3, 1), 2),
]


def median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def xla_times(size: int, cin: int, cout: int, k: int, stride: int) -> tuple[float, ...]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, size, size, cin), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((k, k, cin, cout), dtype=np.float32) * 0.01)
    pad = [(k // 2, k // 2)] * 2

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (stride, stride), pad, dimension_numbers=("NHWC", "HWIO", "NHWC"))

    g = jnp.ones_like(conv(x, w))
    forward = jax.jit(lambda x, w, g: conv(x, w))
    d_input = jax.jit(lambda x, w, g: jax.vjp(lambda x: conv(x, w), x)[1](g)[0])
    d_weight = jax.jit(lambda x, w, g: jax.vjp(lambda w: conv(x, w), w)[1](g)[0])
    times = [median_ms(lambda f=f: jax.block_until_ready(f(x, w, g))) for f in (forward, d_input, d_weight)]
    if k == 1 and stride == 1:
        matmul = jax.jit(lambda x, g: x.reshape(-1, cin).T @ g.reshape(-1, cout))
        times.append(median_ms(lambda: jax.block_until_ready(matmul(x, g))))
    else:
        times.append(float("nan"))
    return tuple(times)


def onednn_times(size: int, cin: int, cout: int, k: int, stride: int) -> tuple[float, ...]:
    """The same three passes as xlafit's oneDNN FFI calls (:mod:`xlafit.native.onednn`)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, size, size, cin), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((k, k, cin, cout), dtype=np.float32) * 0.01)
    attrs, pads = onednn._conv_attrs((stride, stride), ((k // 2, k // 2),) * 2), ((k // 2, k // 2),) * 2
    g = jnp.ones_like(onednn._conv(x, w, (stride, stride), pads))
    forward = jax.jit(lambda x, w, g: onednn._conv(x, w, (stride, stride), pads))
    d_weight = jax.jit(
        lambda x, w, g: onednn._call("conv_bwd_weights", jax.ShapeDtypeStruct(w.shape, w.dtype), x, g, **attrs)
    )
    d_input = jax.jit(
        lambda x, w, g: onednn._call("conv_bwd_data", jax.ShapeDtypeStruct(x.shape, x.dtype), g, w, w, **attrs)
    )
    return tuple(median_ms(lambda f=f: jax.block_until_ready(f(x, w, g))) for f in (forward, d_input, d_weight))


def torch_times(size: int, cin: int, cout: int, k: int, stride: int) -> tuple[float, ...]:
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((BATCH, cin, size, size), dtype=np.float32))
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.from_numpy(rng.standard_normal((cout, cin, k, k), dtype=np.float32) * 0.01)
    w = w.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        forward = median_ms(lambda: F.conv2d(x, w, stride=stride, padding=k // 2))
    # The gradients through autograd on one recorded forward (retain_graph), as loss.backward() runs
    # them: torch.nn.grad.conv2d_input builds a contiguous (NCHW) input and takes a slower path.
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = F.conv2d(x, w, stride=stride, padding=k // 2)
    g = torch.ones_like(y)
    return (
        forward,
        median_ms(lambda: torch.autograd.grad(y, [x], g, retain_graph=True)),
        median_ms(lambda: torch.autograd.grad(y, [w], g, retain_graph=True)),
    )


def main() -> None:
    xlafit.connect()
    torch.set_num_threads(2)
    print(f"batch {BATCH}, float32, NHWC; ms, median of {REPEATS}")
    assert onednn.status().available, onednn.status().reason
    print(
        "| layer (HxW, Cin->Cout, k, stride) | XLA fwd | XLA d-input | XLA d-weight | XLA x.T@g | oneDNN fwd "
        "| oneDNN d-input | oneDNN d-weight | XLA / oneDNN (sum) | xlafit's oneDNN calls fwd / d-input / d-weight |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    total_xla = total_torch = total_ffi = 0.0
    layers = ALL_LAYERS if "all" in sys.argv[3:] else [(layer, 1) for layer in LAYERS]
    for layer, count in layers:
        ours, theirs, ffi = xla_times(*layer), torch_times(*layer), onednn_times(*layer)
        stem = layer[1] == 3  # training never needs the stem's input gradient: left out of the totals
        total_xla += count * (sum(ours[:3]) - (ours[1] if stem else 0))
        total_torch += count * (sum(theirs) - (theirs[1] if stem else 0))
        total_ffi += count * (sum(ffi) - (ffi[1] if stem else 0))
        size, cin, cout, k, stride = layer
        cells = [f"{t:.1f}" if t == t else "-" for t in ours + theirs]
        ratio = sum(ours[:3]) / sum(theirs)
        times = f" (x{count})" if count > 1 else ""
        print(
            f"| {size}x{size}, {cin}->{cout}, {k}x{k}, /{stride}{times} | "
            + " | ".join(cells)
            + f" | {ratio:.2f} | "
            + " / ".join(f"{t:.1f}" for t in ffi)
            + " |",
            flush=True,
        )
    print(
        f"all layers (without the stem's input gradient): XLA {total_xla:.1f} ms, PyTorch's oneDNN "
        f"{total_torch:.1f} ms ({total_xla / total_torch:.2f}x), xlafit's oneDNN calls {total_ffi:.1f} ms"
    )


if __name__ == "__main__":
    main()
