"""Generation speed: xlafit's cached generation against ``transformers``' ``generate`` on the
same weights on this machine's CPU (a record, not a goal: the CPU is for rehearsal), and the
step model's tokens/s for the same loop compiled for a TPU (a prediction, shown as one).

    JAX_PLATFORMS=cpu python benchmarks/speed/generate_speed.py cpu [--runs 5] [--json FILE]
    JAX_PLATFORMS=cpu python benchmarks/speed/generate_speed.py rollout [--runs 5] [--json FILE]
    JAX_PLATFORMS=cpu python benchmarks/speed/generate_speed.py tpu v5e-1 [--json FILE]

``cpu``: a 4-layer Llama (hidden 512, vocabulary 32,000, 44M parameters) in float32, a batch
of 4 prompts of 32 tokens, 64 new tokens each, greedy; the median of ``--runs`` timed calls
after one untimed call each (xlafit's compile is timed apart); the tokens of both must be
equal. ``rollout``: the same model sampling as a GRPO rollout does, ``G`` completions of each
prompt in one batch (8 prompts x 8 = 64 rows, 32 new tokens each, temperature 0.7, no stop),
against ``transformers``' ``generate`` with the same sampling settings, which is what TRL's
``GRPOTrainer`` calls to sample when it runs without vLLM; the tokens differ (two random
streams), so the comparison is of tokens/s alone. ``tpu``: the 1B presets (Llama 3.2 1B,
Gemma 3 1B) in bfloat16, prompts of 128 tokens, 256 new tokens, batches 1 and 8, compiled
for the target with the TPU compiler; the step model prices the whole compiled loop (prefill
and every decode step).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlafit.models.generation import Sampling, _run, generate
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM

CPU_MODEL = dict(
    num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1376, vocab_size=32000,
    max_position_embeddings=256,
)  # fmt: skip
CPU_BATCH, CPU_PROMPT, CPU_NEW = 4, 32, 64
TPU_PROMPT, TPU_NEW = 128, 256


def _median(fn: Any, runs: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _model_pair() -> tuple[LlamaForCausalLM, Any]:
    """The CPU model in xlafit, and the same weights in ``transformers`` (float32)."""
    import tempfile

    import torch
    import transformers

    from xlafit.hf import llama as llama_hf

    torch.set_num_threads(os.cpu_count() or 1)
    model = LlamaForCausalLM(LlamaConfig(**CPU_MODEL), rngs=nnx.Rngs(0))
    with tempfile.TemporaryDirectory() as folder:
        llama_hf.save_hf(model, folder)
        theirs = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    return model, theirs


def _machine() -> dict[str, Any]:
    import torch
    import transformers

    return {
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }


def cpu(runs: int) -> dict[str, Any]:
    import torch

    model, theirs = _model_pair()
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, CPU_MODEL["vocab_size"], (CPU_BATCH, CPU_PROMPT)).tolist()

    t0 = time.perf_counter()
    ours = generate(model, prompts, CPU_NEW)
    first_s = time.perf_counter() - t0
    ours_s, ours_runs = _median(lambda: generate(model, prompts, CPU_NEW), runs)

    ids = torch.tensor(prompts)

    def hf() -> Any:
        with torch.no_grad():
            return theirs.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=CPU_NEW, min_new_tokens=CPU_NEW,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip

    out = hf()
    theirs_s, theirs_runs = _median(hf, runs)
    tokens = CPU_BATCH * CPU_NEW
    return {
        "model": CPU_MODEL,
        "parameters": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "batch": CPU_BATCH,
        "prompt_tokens": CPU_PROMPT,
        "new_tokens": CPU_NEW,
        "tokens_equal": ours == out[:, CPU_PROMPT:].tolist(),
        "xlafit": {"first_call_s": first_s, "runs_s": ours_runs, "median_s": ours_s, "tokens_per_s": tokens / ours_s},
        "transformers": {"runs_s": theirs_runs, "median_s": theirs_s, "tokens_per_s": tokens / theirs_s},
        "xlafit_over_transformers": theirs_s / ours_s,
        **_machine(),
    }


ROLLOUT_PROMPTS, ROLLOUT_G, ROLLOUT_NEW, ROLLOUT_TEMPERATURE = 8, 8, 32, 0.7


def rollout(runs: int) -> dict[str, Any]:
    """Sampled rollouts: xlafit's ``generate`` against ``transformers.generate``, interleaved."""
    import torch

    model, theirs = _model_pair()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, CPU_MODEL["vocab_size"], (ROLLOUT_PROMPTS, CPU_PROMPT)).tolist()
    rows = [p for p in prompts for _ in range(ROLLOUT_G)]  # each prompt's G rows adjacent, as a rollout's
    ids = torch.tensor(rows)

    def ours(seed: int) -> Any:
        return generate(model, rows, ROLLOUT_NEW, Sampling(ROLLOUT_TEMPERATURE, seed=seed))

    def hf() -> Any:
        with torch.no_grad():
            return theirs.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=ROLLOUT_NEW,
                min_new_tokens=ROLLOUT_NEW, do_sample=True, temperature=ROLLOUT_TEMPERATURE, top_k=0, top_p=1.0,
                pad_token_id=0, eos_token_id=None,
            )  # fmt: skip

    t0 = time.perf_counter()
    ours(0)
    first_s = time.perf_counter() - t0
    hf()  # its first call too, untimed
    ours_runs, theirs_runs = [], []
    for r in range(runs):  # interleaved: a shared machine's load drifts
        t0 = time.perf_counter()
        got = ours(r + 1)
        ours_runs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = hf()
        theirs_runs.append(time.perf_counter() - t0)
    assert all(len(t) == ROLLOUT_NEW for t in got) and out.shape == (len(rows), CPU_PROMPT + ROLLOUT_NEW)
    tokens = len(rows) * ROLLOUT_NEW
    ours_s, theirs_s = statistics.median(ours_runs), statistics.median(theirs_runs)
    return {
        "model": CPU_MODEL,
        "parameters": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "prompts": ROLLOUT_PROMPTS,
        "generations_per_prompt": ROLLOUT_G,
        "rows": len(rows),
        "prompt_tokens": CPU_PROMPT,
        "new_tokens": ROLLOUT_NEW,
        "temperature": ROLLOUT_TEMPERATURE,
        "xlafit": {"first_call_s": first_s, "runs_s": ours_runs, "median_s": ours_s, "tokens_per_s": tokens / ours_s},
        "transformers": {"runs_s": theirs_runs, "median_s": theirs_s, "tokens_per_s": tokens / theirs_s},
        "xlafit_over_transformers": theirs_s / ours_s,
        **_machine(),
    }


def tpu(name: str) -> list[dict[str, Any]]:
    from jax.sharding import NamedSharding, PartitionSpec

    from xlafit.check.tpu import _compile, no_persistent_cache
    from xlafit.platform.hardware import devices, parse_targets
    from xlafit.predict.model import predict
    from xlafit.predict.rates import rates_for

    target = parse_targets(name)[0]
    rates = rates_for(target.generation.device_kinds[0])
    assert rates is not None, f"no rates for {name}"
    mesh = jax.sharding.Mesh(np.array(devices(target)[:1]), ("x",))
    whole = NamedSharding(mesh, PartitionSpec())
    rows = []
    for preset in ("llama-3.2-1b", "gemma-3-1b"):
        cfg = LlamaConfig.preset(preset, dtype="bfloat16", param_dtype="bfloat16", scan_layers=preset != "gemma-3-1b")
        abstract = nnx.eval_shape(lambda cfg=cfg: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole), state)
        weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        for batch in (1, 8):
            ids = jax.ShapeDtypeStruct((batch, TPU_PROMPT), jnp.int32, sharding=whole)
            pads = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=whole)
            stops = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=whole)  # the end-of-sequence id
            seed = jax.ShapeDtypeStruct((), jnp.uint32, sharding=whole)
            with no_persistent_cache():
                lower = functools.partial(_run.lower, graphdef, state, ids, pads, stops, seed, TPU_NEW, Sampling())
                compiled, compile_s = _compile(lower)
            step = predict(compiled.as_text(), rates, target.ici_bandwidth, target.num_devices)
            # The floor: every decode step reads every weight once from HBM.
            floor_s = TPU_NEW * weight_bytes / target.hbm_bandwidth
            rows.append(
                {
                    "target": name,
                    "preset": preset,
                    "batch": batch,
                    "prompt_tokens": TPU_PROMPT,
                    "new_tokens": TPU_NEW,
                    "weight_bytes": weight_bytes,
                    "compile_s": compile_s,
                    "predicted_s": step.seconds,
                    "predicted_tokens_per_s": batch * TPU_NEW / step.seconds,
                    "predicted_ms_per_token": 1e3 * step.seconds / TPU_NEW,
                    "weights_read_floor_s": floor_s,
                    "band": dataclasses.asdict(rates.band) if rates.band else None,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["cpu", "rollout", "tpu"])
    parser.add_argument("target", nargs="?", default="v5e-1")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    parts = {"cpu": lambda: cpu(args.runs), "rollout": lambda: rollout(args.runs), "tpu": lambda: tpu(args.target)}
    result: Any = parts[args.part]()
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
