"""Peak FLOP/s of a device, the denominator of MFU (model FLOPs utilisation).

MFU = model FLOPs per second achieved / peak FLOP/s (PaLM, Chowdhery et al. 2022, app. B).
Accelerators: the vendor's dense bf16 matrix peak per JAX device (sparsity excluded), as
MaxText and nanoGPT count it; a float32 model is measured against the same bf16 peak, so
its MFU reads low by design. CPUs have no honest datasheet number for this, so the peak is
a float32 matrix product measured on the spot on all cores (:func:`measured_cpu_peak`).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

# device_kind substring -> (dense bf16 TFLOP/s per JAX device, source). TPU v2/v3 show each
# of a chip's two TensorCores as a device, so the chip's peak is halved; v4 and v5p
# (megacore) and the single-core v5e/v6e chips are one device per chip.
PEAK_BF16_TFLOPS: dict[str, tuple[float, str]] = {
    "TPU v2": (22.5, "cloud.google.com/tpu/docs/v2: 45 TFLOP/s per chip, 2 cores"),
    "TPU v3": (61.5, "cloud.google.com/tpu/docs/v3: 123 TFLOP/s per chip, 2 cores"),
    "TPU v4": (275.0, "cloud.google.com/tpu/docs/v4: 275 TFLOP/s per chip"),
    "TPU v5 lite": (197.0, "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s per chip"),
    "TPU v5e": (197.0, "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s per chip"),
    "TPU v5p": (459.0, "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s per chip"),
    "TPU v5": (459.0, "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s per chip"),
    "TPU v6 lite": (918.0, "cloud.google.com/tpu/docs/v6e: 918 TFLOP/s per chip"),
    "TPU v6e": (918.0, "cloud.google.com/tpu/docs/v6e: 918 TFLOP/s per chip"),
    "A100": (312.0, "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense"),
    "H100 PCIe": (756.0, "NVIDIA H100 datasheet: PCIe 756 TFLOP/s bf16 dense (1513 sparse)"),
    "H100": (989.0, "NVIDIA H100 datasheet: SXM 989 TFLOP/s bf16 dense (1979 sparse)"),
    "H200": (989.0, "NVIDIA H200 datasheet: 989 TFLOP/s bf16 dense (1979 sparse)"),
}


def table_peak(device_kind: str) -> tuple[float, str] | None:
    """``(peak FLOP/s, source)`` of one device from :data:`PEAK_BF16_TFLOPS`, or None.

    The longest matching name wins, so "H100 PCIe" is not read as "H100".

    Example:
        >>> table_peak("NVIDIA H100 80GB HBM3")[0]
        989000000000000.0
        >>> table_peak("cpu") is None
        True
    """
    matches = [name for name in PEAK_BF16_TFLOPS if name.lower() in device_kind.lower()]
    if not matches:
        return None
    tflops, source = PEAK_BF16_TFLOPS[max(matches, key=len)]
    return tflops * 1e12, source


def measured_cpu_peak(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n`` float32 matrix product on this machine's CPU, all cores.

    The median of ``repeats`` timed products after one warm-up. Simulated CPU devices share
    these cores, so this is the peak of the whole machine, not of one simulated device.
    """
    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), jnp.float32), cpu)
    matmul = jax.jit(jnp.matmul)
    matmul(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a, a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def peak_flops(devices: list[jax.Device]) -> tuple[float, str]:
    """``(peak FLOP/s, how it was found)`` of ``devices`` together.

    Raises:
        LookupError: an accelerator missing from :data:`PEAK_BF16_TFLOPS`.
    """
    if devices[0].platform == "cpu":
        return measured_cpu_peak(), "float32 2048^3 matmul measured on this CPU (all cores)"
    found = table_peak(devices[0].device_kind)
    if found is None:
        raise LookupError(
            f"no peak FLOP/s known for {devices[0].device_kind!r}; add it to xlafit.platform.hardware.PEAK_BF16_TFLOPS."
        )
    per_device, source = found
    return per_device * len(devices), f"{len(devices)} x {source}"
