"""PyTorch peers for ``xlafit bench``: the same model, batch and optimizer, in eager mode
or under ``torch.compile``, timed the way the xlafit configurations are.

Imported only inside a benchmark worker process (torch is an optional dependency:
``pip install 'xlafit[bench]'``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from xlafit.platform.cpu import page_faults, page_faults_since, peak_rss_bytes


def mnist_net() -> Any:
    """pytorch/examples ``mnist/main.py``'s ``Net``, the model :class:`xlafit.models.MnistCNN` copies."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, 1)
            self.conv2 = nn.Conv2d(32, 64, 3, 1)
            self.dropout1 = nn.Dropout(0.25)
            self.dropout2 = nn.Dropout(0.5)
            self.fc1 = nn.Linear(9216, 128)
            self.fc2 = nn.Linear(128, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.relu(self.conv2(F.relu(self.conv1(x))))
            x = self.dropout1(F.max_pool2d(x, 2))
            x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
            return self.fc2(x)

    return Net()


def run_mnist(
    images: np.ndarray, labels: np.ndarray, *, batch: int, warmup: int, steps: int, compile: bool
) -> dict[str, Any]:
    """Trains the CNN with Adam (lr 1e-3) for ``warmup + steps`` steps; times the last ``steps``.

    Each step: gather the batch from a shuffled order (the input wait), then forward,
    backward and update (the step time).
    """
    import torch
    import torch.nn.functional as F

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = mnist_net().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    forward = torch.compile(model) if compile else model
    model.train()

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(forward(x), y)

    return _timed_training(loss_of, opt, images, labels, batch=batch, warmup=warmup, steps=steps, compile=compile)


def normalise_pixels(x: Any, mean: tuple[float, ...], std: tuple[float, ...]) -> Any:
    """``uint8 [B, C, H, W]`` pixels -> float32 ``(x / 255 - mean) / std`` per channel, on
    ``x``'s device: what :class:`xlafit.recipes.resnet.ImageClassifier` does first."""
    import torch

    shape = (1, -1, 1, 1)
    m, s = (torch.tensor(v, device=x.device).reshape(shape) for v in (mean, std))
    return (x.float() * (1.0 / 255.0) - m) / s


def run_resnet(
    images: np.ndarray,
    labels: np.ndarray,
    hf_config: dict[str, Any],
    normalisation: tuple[tuple[float, ...], tuple[float, ...]],
    *,
    batch: int,
    warmup: int,
    steps: int,
    compile: bool,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Trains Hugging Face's ``ResNetForImageClassification`` (built from ``hf_config``, the
    same sizes as the xlafit model) in channels-last memory format, with the xlafit rows'
    optimizer: SGD, Nesterov momentum 0.9, learning rate 0.1, weight decay 5e-5 on the
    convolution and classifier weights only. ``dtype="bfloat16"``: the forward and backward
    under ``torch.autocast`` (bf16 compute, float32 weights), as xlafit's bf16 rows.
    ``uint8`` images are scaled to [0, 1] and normalised with ``normalisation`` (mean, std)
    on the device first, as the xlafit rows do."""
    import torch
    import torch.nn.functional as F
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = transformers.ResNetConfig(
        **{k: v for k, v in hf_config.items() if k not in ("architectures", "torch_dtype")}
    )
    model = transformers.ResNetForImageClassification(config)
    model = model.to(device=device, memory_format=torch.channels_last)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.SGD(
        [{"params": matrices, "weight_decay": 5e-5}, {"params": others, "weight_decay": 0.0}],
        lr=0.1,
        momentum=0.9,
        nesterov=True,
    )
    forward = torch.compile(model) if compile else model
    model.train()

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:
            x = normalise_pixels(x, *normalisation)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits = forward(pixel_values=x.contiguous(memory_format=torch.channels_last)).logits
        return F.cross_entropy(logits.float(), y)

    result = _timed_training(loss_of, opt, images, labels, batch=batch, warmup=warmup, steps=steps, compile=compile)
    result["versions"]["transformers"] = transformers.__version__
    return result


def _timed_training(
    loss_of: Any,
    opt: Any,
    images: np.ndarray,
    labels: np.ndarray,
    *,
    batch: int,
    warmup: int,
    steps: int,
    compile: bool,
) -> dict[str, Any]:
    """``warmup + steps`` steps of ``loss_of(x, y)``, backward and ``opt.step()``; times the last ``steps``."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    next_batch = _sampler(images, labels, batch, device)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(x, y)
        loss.backward()
        opt.step()
        return loss

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    warmup_s = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        step(*next_batch())
        sync()
        warmup_s.append(time.perf_counter() - t0)

    # Timed like the xlafit rows: no sync per step (CUDA queues kernels ahead, as JAX
    # dispatches calls ahead), one at the end; a step's time is the interval since the
    # previous step returned, less its input wait.
    step_s, wait_s = [], 0.0
    faults = page_faults()
    t_start = t_mark = time.perf_counter()
    for i in range(steps):
        x, y = next_batch()
        t1 = time.perf_counter()
        loss = step(x, y)
        if i == steps - 1:
            sync()
        t2 = time.perf_counter()
        wait_s += t1 - t_mark
        step_s.append(t2 - t1)
        t_mark = t2
    wall_s = time.perf_counter() - t_start
    timed_faults = page_faults_since(faults)
    final_loss = loss.item()
    median = float(np.median(step_s))
    return {
        "platform": device,
        "device_kind": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "devices": 1,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "call_steps": [1] * steps,
        "call_s": step_s,
        "wait_s": wait_s,
        "wall_s": wall_s,
        # torch.compile compiles during the first steps: their time beyond a steady step.
        "compile_s": max(sum(warmup_s) - warmup * median, 0.0) if compile else None,
        "compiles": None,
        "final_loss": final_loss,
        "page_faults": timed_faults,
        "peak_rss_bytes": peak_rss_bytes(),
        "versions": {"torch": torch.__version__},
    }


def _sampler(images: np.ndarray, labels: np.ndarray, batch: int, device: str) -> Callable[[], tuple[Any, Any]]:
    """Random batches without replacement, reshuffled each epoch, from a set that lives on the
    device (as a DataLoader with pinned memory would have it ready)."""
    import torch

    # NHWC (JAX's layout) -> NCHW (PyTorch's)
    x_all = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))).to(device)
    y_all = torch.from_numpy(labels.astype(np.int64)).to(device)
    n = len(labels)
    perm, pos = torch.randperm(n, device=device), 0

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal perm, pos
        if pos + batch > n:
            perm, pos = torch.randperm(n, device=device), 0
        idx = perm[pos : pos + batch]
        pos += batch
        return x_all[idx], y_all[idx]

    return next_batch
