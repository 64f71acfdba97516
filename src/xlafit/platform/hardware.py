"""The hardware: the table of TPU generations and GPUs (:mod:`xlafit.platform.chips`) and TPU
slices by name with their devices for the compiler (:mod:`xlafit.platform.slices`), under one
name.

Example:
    >>> parse_target("colab").name, GENERATIONS["v5e"].hbm_gib
    ('colab = v5e-1', 16)
"""

from xlafit.platform.chips import (
    GENERATIONS,
    GPU_HBM,
    GPUS,
    HOST_LINK,
    PRICES,
    Generation,
    Price,
    device_peaks,
    measured_cpu_peak,
    peak_flops,
    table_bandwidth,
    table_host_bandwidth,
    table_memory,
    table_peak,
)
from xlafit.platform.slices import (
    ACCELERATOR_DEVICES,
    ALIASES,
    INSTALL,
    KNOWN,
    LIBTPU_MODULE,
    TPU_DEVICES,
    Target,
    accelerator_present,
    command_name,
    devices,
    parse_target,
    parse_targets,
    quiet_stderr,
    require_libtpu,
)

__all__ = [
    "ACCELERATOR_DEVICES",
    "ALIASES",
    "GENERATIONS",
    "GPUS",
    "GPU_HBM",
    "HOST_LINK",
    "INSTALL",
    "KNOWN",
    "LIBTPU_MODULE",
    "PRICES",
    "TPU_DEVICES",
    "Generation",
    "Price",
    "Target",
    "accelerator_present",
    "command_name",
    "device_peaks",
    "devices",
    "measured_cpu_peak",
    "parse_target",
    "parse_targets",
    "peak_flops",
    "quiet_stderr",
    "require_libtpu",
    "table_bandwidth",
    "table_host_bandwidth",
    "table_memory",
    "table_peak",
]
