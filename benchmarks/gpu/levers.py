"""BERT-base's and the 1B Llama's step on a GPU, lever by lever, each in a fresh process,
beside their PyTorch peers in the same run.

Each variant is the recipe's run as ``xlafit train`` builds it (``measured.py``'s
workloads: BERT-base MLM at 256 x 128, the llm recipe's ``llama-3.2-1b`` at 8 x 1024, bf16
compute) with one change, timed with the trainer's own dispatch loop (warm-up, then the
median step); its MFU is the recipe's model FLOPs over the device's bf16 peak. The
levers (what the stored H200 profile found, ``benchmarks/predict/kernel_sources.py``):

  bert, llm                the recipe as it is
  *-plain-activations      jax.nn.gelu and jax.nn.silu(g) * u again, whose derivatives keep
                           3 and 5 arrays for the backward (the program before
                           xlafit.models.activations): what that change gained
  bert-rbg, bert-unsafe-rbg  dropout's bits from XLA's RngBitGenerator instead of threefry
                           (JAX_DEFAULT_PRNG_IMPL; 2 % of the step was the threefry hash; rbg
                           was no faster on an H200)
  bert-cudnn-layer-norm, bert-no-triton-gemm   XLA flags
  bert-vocab-30592         the vocabulary padded to a multiple of 128 (the MLM head's
                           gradient GEMM ran at a third of the card's rate at 30,522)
  bert-b512                twice the batch
  llm-cudnn                packed rows through cuDNN's flash attention
                           (model.attention=cudnn; 32 % of the step was XLA's attention over
                           float32 [B, heads, T, T] scores), checked against model.attention=xla
                           on the same batch first (loss and gradient)
  llm-cudnn-b16            and twice the batch
  llm-logits-chunk         the loss 1,024 positions at a time (model.logits_chunk: memory for a
                           recomputed output layer)
  bert-hf                  Hugging Face BertForMaskedLM + SDPA (bert_speed.py's row)
  llm-torch, llm-torch-compile   transformers' LlamaForCausalLM + SDPA at the same sizes,
                           eager and torch.compile (float32 weights, bf16 autocast; random
                           tokens, unpacked rows)

    PYTHONPATH=src python3 benchmarks/gpu/levers.py --group bert --json $OUT/bert.json   # ~6 min
    PYTHONPATH=src python3 benchmarks/gpu/levers.py --group llm --json $OUT/llm.json     # ~7 min
    PYTHONPATH=src python3 benchmarks/gpu/levers.py --group more --json $OUT/more.json   # XLA flags, batch
    # rehearsal on a CPU (small presets; the GPU-only variants fail and say so):
    JAX_PLATFORMS=cpu PYTHONPATH=src .venv/bin/python benchmarks/gpu/levers.py --size tiny \
        --variants bert,bert-plain-activations,llm,llm-torch --json /tmp/levers.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# name: (workload, environment, overrides)
VARIANTS: dict[str, tuple[str, dict[str, str], list[str]]] = {
    "bert": ("bert", {}, []),
    "bert-plain-activations": ("bert", {}, []),
    "bert-rbg": ("bert", {"JAX_DEFAULT_PRNG_IMPL": "rbg"}, []),
    "bert-unsafe-rbg": ("bert", {"JAX_DEFAULT_PRNG_IMPL": "unsafe_rbg"}, []),
    "bert-cudnn-layer-norm": ("bert", {"XLA_FLAGS": "--xla_gpu_enable_cudnn_layer_norm=true"}, []),
    "bert-no-triton-gemm": ("bert", {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}, []),
    "bert-vocab-30592": ("bert", {}, ["data.vocab_size=30592"]),
    "bert-b512": ("bert", {}, ["data.global_batch=512"]),
    "llm": ("llm", {}, []),
    "llm-plain-activations": ("llm", {}, []),
    "llm-cudnn": ("llm", {}, ["model.attention=cudnn"]),
    "llm-cudnn-b16": ("llm", {}, ["model.attention=cudnn", "data.global_batch=16"]),
    "llm-logits-chunk": ("llm", {}, ["model.logits_chunk=1024"]),
    "bert-hf": ("bert", {}, []),
    "llm-torch": ("llm", {}, []),
    "llm-torch-compile": ("llm", {}, []),
}

# What fits one call of a lent GPU (10 minutes), the most telling first.
GROUPS = {
    "bert": ["bert", "bert-plain-activations", "bert-hf", "bert-vocab-30592", "bert-unsafe-rbg"],
    "llm": ["llm", "llm-cudnn", "llm-torch", "llm-torch-compile", "llm-plain-activations", "llm-cudnn-b16"],
    "more": ["bert-cudnn-layer-norm", "bert-no-triton-gemm", "bert-b512", "llm-logits-chunk"],
}


def _plain_activations() -> None:
    """The models' activations as they were before xlafit.models.activations."""
    import jax

    import xlafit.models.bert as bert
    import xlafit.models.llama as llama

    def gated(gate: Any, up: Any, activation: str) -> Any:
        act = jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)
        return act * up

    bert.gelu = functools.partial(jax.nn.gelu, approximate=False)  # type: ignore[assignment]
    llama.gated = gated  # type: ignore[assignment]


def _same_batch_check(recipe_name: str, overrides: list[str]) -> dict[str, float]:
    """model.attention=cudnn against xla on one batch of the run's data: loss and gradients."""
    import jax
    import numpy as np
    from flax import nnx

    from xlafit.recipes import get_recipe, load_config

    recipe = get_recipe(recipe_name)
    train = recipe.load_data(load_config(recipe_name, overrides))[0]  # the same rows for both
    batch = {k: jax.numpy.asarray(v) for k, v in train.take(np.arange(8)).items()}
    results = {}
    for attention in ("xla", "cudnn"):
        model = recipe.build_model(load_config(recipe_name, [*overrides, f"model.attention={attention}"]), train)

        def loss(m: Any, b: dict = batch) -> Any:
            value = recipe.loss_fn(m, b)
            return (value[0] if isinstance(value, tuple) else value).mean()

        value, grads = nnx.value_and_grad(loss)(model)
        flat = np.concatenate([np.asarray(g, np.float32).ravel() for g in jax.tree.leaves(nnx.state(grads))])
        results[attention] = (float(value), flat)
    (a, ga), (b, gb) = results["xla"], results["cudnn"]
    return {
        "loss_xla": a,
        "loss_cudnn": b,
        "loss_rel_diff": abs(a - b) / abs(a),
        "grad_rel_diff": float(np.linalg.norm(ga - gb) / np.linalg.norm(ga)),
    }


def run_xlafit(name: str, size: str, warmup: int, steps: int) -> dict[str, Any]:
    import jax
    from measured import build_trainer, overrides_of

    from xlafit.bench.worker import _timed_calls
    from xlafit.platform.hardware import table_peak
    from xlafit.recipes import get_recipe, load_config

    workload, _, extra = VARIANTS[name]
    if name.endswith("plain-activations"):
        _plain_activations()
    recipe_name, overrides = overrides_of(workload, size)
    overrides = [*overrides, *extra]
    out: dict[str, Any] = {"variant": name, "overrides": overrides}
    if "model.attention=cudnn" in extra:
        out["same_batch"] = _same_batch_check(recipe_name, overrides)
    trainer, train, run = build_trainer(recipe_name, overrides)
    timed = _timed_calls(trainer, train, warmup, warmup + steps)
    step = statistics.median(timed["call_s"])
    recipe = get_recipe(recipe_name)
    throughput = recipe.throughput(recipe.from_data(load_config(recipe_name, overrides), train), train)
    flops = throughput.get("flops_per_example", 0.0) * run.global_batch
    peak = table_peak(jax.devices()[0].device_kind)
    out.update(
        step_s=step,
        global_batch=run.global_batch,
        examples_per_s=run.global_batch / step,
        flops_per_step=flops,
        mfu=flops / step / peak[0] if peak and flops else None,
        compile_s=trainer.train_step.compile_s,
        final_loss=timed["final_loss"],
    )
    return out


def run_torch_llama(name: str, size: str, warmup: int, steps: int) -> dict[str, Any]:
    """transformers' LlamaForCausalLM + SDPA at the preset's sizes: float32 weights, bf16
    autocast, fused AdamW (the mixed precision of xlafit's bf16 compute)."""
    import numpy as np
    import torch
    import transformers
    from measured import overrides_of

    from xlafit.hf.config_json import hf_config
    from xlafit.models.llama import LlamaConfig
    from xlafit.platform.hardware import table_peak

    _, overrides = overrides_of("llm", size)
    settings = dict(o.split("=", 1) for o in overrides)
    preset, seq, batch = settings["model.preset"], int(settings["data.seq_len"]), int(settings["data.global_batch"])
    cfg = LlamaConfig.preset(preset, vocab_size=128256 if preset != "tiny" else 512)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    hf = transformers.LlamaConfig(**{k: v for k, v in hf_config(cfg).items() if k != "architectures"})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(hf, attn_implementation="sdpa", torch_dtype=torch.float32)
    model.to(device).train()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    forward = torch.compile(model) if name.endswith("compile") else model
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq))).to(device)

    def step() -> float:
        with autocast:
            loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    median = statistics.median(times)
    flops = cfg.train_flops_per_token(seq) * seq * batch
    peak = table_peak(torch.cuda.get_device_name() if cuda else "cpu")
    return {
        "variant": name,
        "step_s": median,
        "global_batch": batch,
        "examples_per_s": batch / median,
        "flops_per_step": flops,
        "mfu": flops / median / peak[0] if peak else None,
        "warmup_s": first,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def run_bert_hf(size: str, out: Path) -> dict[str, Any]:
    args = (
        ["--preset", "mini", "--batch", "32", "--dtype", "float32", "--steps", "4", "--warmup", "2"]
        if size == "tiny"
        else ["--preset", "base", "--batch", "256", "--dtype", "bfloat16", "--steps", "20", "--warmup", "3"]
    )
    part = out.with_suffix(".bert-hf.json")
    subprocess.run(
        [
            sys.executable,
            str(HERE.parent / "speed" / "bert_speed.py"),
            *args,
            "--repeats",
            "1",
            "--rows",
            "hf",
            "--json",
            str(part),
        ],
        check=True,
    )
    return {"variant": "bert-hf", "bert_speed": json.loads(part.read_text())}


def one(name: str, size: str, warmup: int, steps: int, out: Path) -> dict[str, Any]:
    if name == "bert-hf":
        return run_bert_hf(size, out)
    if name.startswith("llm-torch"):
        return run_torch_llama(name, size, warmup, steps)
    return run_xlafit(name, size, warmup, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", help="comma-separated names (default: all, or --group's)")
    p.add_argument("--group", choices=sorted(GROUPS), help="the variants of one call")
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--limit", type=int, default=150, help="seconds per variant")
    p.add_argument("--json", required=True, help="every variant's result (written after each)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one variant, its JSON to --json
    args = p.parse_args()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.one:
        out.write_text(json.dumps(one(args.one, args.size, args.warmup, args.steps, out), indent=2, default=str))
        return
    results = []
    names = args.variants.split(",") if args.variants else GROUPS[args.group] if args.group else list(VARIANTS)
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; one of {', '.join(VARIANTS)}")
        part = out.with_suffix(f".{name}.json")
        env = {**os.environ, **VARIANTS[name][1]}
        if "XLA_FLAGS" in VARIANTS[name][1] and os.environ.get("XLA_FLAGS"):
            env["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {VARIANTS[name][1]['XLA_FLAGS']}"
        command = [sys.executable, __file__, "--one", name, "--size", args.size, "--json", str(part)]
        command += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(command, env=env, timeout=args.limit, capture_output=True, text=True)
            result = (
                json.loads(part.read_text())
                if done.returncode == 0
                else {"variant": name, "error": done.stderr[-2000:]}
            )
        except subprocess.TimeoutExpired:
            result = {"variant": name, "error": f"over its {args.limit} s"}
        result["wall_s"] = time.perf_counter() - t0
        results.append(result)
        out.write_text(json.dumps(results, indent=2, default=str))
        if "error" in result:
            lines = [x for x in result["error"].splitlines() if "Error:" in x or "over its" in x] or ["?"]
            print(f"{name}: failed ({lines[-1].strip()})", flush=True)
            continue
        if name == "bert-hf":
            print(f"{name}: {json.dumps(result['bert_speed'])[:300]}", flush=True)
            continue
        mfu = f"{result['mfu']:.1%}" if result.get("mfu") else "-"
        check = f"; vs xla on one batch: {result['same_batch']}" if "same_batch" in result else ""
        print(
            f"{name}: {result['step_s'] * 1e3:.1f} ms a step, MFU {mfu} ({result['wall_s']:.0f} s){check}", flush=True
        )


if __name__ == "__main__":
    main()
