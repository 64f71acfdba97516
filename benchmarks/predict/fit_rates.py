"""Makes ``src/xlafit/predict/rates.json``, the step model's built-in rows, from the stored
measurements of ``benchmarks/validation`` (see :mod:`xlafit.predict.validation`):

- the H200's row from its micro-benchmarks alone (``gpu-h200/micro.json``); its band from
  the three training steps measured on it, all held out;
- the TPU rows fitted to the published MaxText runs named in ``TPU_FITTED``; their band from
  the other published runs, held out.

    python benchmarks/predict/fit_rates.py          # rewrites rates.json; tests/test_predict.py checks it is current
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xlafit.check.recipes import recipe_program
from xlafit.platform.hardware import parse_targets
from xlafit.predict.rates import BUILT_IN, parameter_count
from xlafit.predict.validation import band_of, fit_gpu, fit_tpu, gpu_checks, tpu_checks, tpu_runs

VALIDATION = Path(__file__).resolve().parents[1] / "validation"
# The published runs the TPU rows are fitted to, chosen before any prediction was compared:
# per generation the runs closest to xlafit's own program (remat full where MaxText ran it).
TPU_FITTED = ("v5e-256-synthetic-16b-b6", "v5e-256-synthetic-64b-b2", "v6e-256-llama2-70b-b4-full",
              "v6e-32-llama3.1-8b-b3", "v5p-128-synthetic-32b-b8-tp4")  # fmt: skip
# H100 and H200 SXM: 132 SMs of 128 float32 lanes at 1.98 GHz (NVIDIA's datasheets: 67 TFLOP/s
# float32, an FMA counted as two).
H200_VECTOR = (33.5e12, "132 SMs x 128 float32 lanes x 1.98 GHz (NVIDIA H200 datasheet: 67 TFLOP/s FP32, FMA = 2)")


def kind(recipe: str, overrides: list[str], devices: int) -> dict[str, Any]:
    """What a measured step's program was (a band's population): its recipe, the parameters
    of the model its overrides build (abstractly: nothing allocated), its devices."""
    program = recipe_program(recipe, overrides)[0]
    training = "full" if not any(o.startswith("lora.rank=") and o != "lora.rank=0" for o in overrides) else "lora"
    return {"family": recipe, "params": parameter_count(program.model), "devices": devices, "training": training}


def gpu_kinds(folder: Path) -> dict[str, dict[str, Any]]:
    """Each stored GPU workload's kind (``bert-b128``: the bert recipe), on one device."""
    summary = json.loads((folder / "summary.json").read_text())
    return {name: kind(name.split("-")[0], w["overrides"], 1) for name, w in summary["workloads"].items()}


def tpu_kinds(folder: Path) -> dict[str, dict[str, Any]]:
    """Each compiled published run's kind: the llm recipe at its first program's overrides."""
    return {
        run["id"]: kind("llm", run["compiled"]["programs"][0]["overrides"], parse_targets(run["target"])[0].num_devices)
        for run in tpu_runs(folder)
    }


def rows() -> list[dict]:
    h200 = fit_gpu(VALIDATION / "gpu-h200", "NVIDIA H200", 132, *H200_VECTOR)
    gpu = gpu_checks(VALIDATION / "gpu-h200", h200)
    out = [{**h200.to_json(), "band": band_of(gpu, "measured", kinds=gpu_kinds(VALIDATION / "gpu-h200"))}]
    tpu = fit_tpu(VALIDATION / "tpu", TPU_FITTED)
    checks = tpu_checks(VALIDATION / "tpu", tpu, TPU_FITTED)
    kinds = tpu_kinds(VALIDATION / "tpu")
    for generation, rates in sorted(tpu.items()):  # each generation's band from its own runs
        mine = [c for c in checks if c.device.startswith(f"{generation}-")]
        fitted = sum(c.role == "fitted" for c in mine)
        out.append({**rates.to_json(), "band": band_of(mine, "published", fitted, kinds)})
    return out


def main() -> None:
    BUILT_IN.write_text(json.dumps(rows(), indent=1) + "\n")
    print(f"wrote {BUILT_IN}")


if __name__ == "__main__":
    main()
