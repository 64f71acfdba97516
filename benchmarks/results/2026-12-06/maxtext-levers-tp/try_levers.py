"""One MaxText published run (benchmarks/validation/tpu/runs.json) compiled at its published
batch with the given settings over its own, and the step model's prediction beside MaxText's
measured step, written as JSON (from the repository root):

    JAX_PLATFORMS=cpu PYTHONPATH=src python benchmarks/results/2026-12-06/maxtext-levers-tp/try_levers.py \
        RUN_ID OUT.json SETTING [SETTING ...]
"""

import json
import sys

sys.path.insert(0, "benchmarks/predict")
import tpu_published as tp  # noqa: E402

from xlafit.platform.hardware import parse_targets  # noqa: E402
from xlafit.predict.model import predict  # noqa: E402
from xlafit.predict.rates import rates_for  # noqa: E402

runs = {r["id"]: r for r in json.loads((tp.HERE / "runs.json").read_text())["runs"]}
run, out, levers = runs[sys.argv[1]], sys.argv[2], sys.argv[3:]
target = parse_targets(run["target"])[0]
record, hlo = tp.compile_at(run, run["batch"], levers)
result = {"id": run["id"], "levers": levers, **record, "published_step_s": run["step_s"]}
if hlo:
    step = predict(hlo, rates_for(target.generation.device_kinds[0]), target.ici_bandwidth, target.num_devices).seconds
    result |= {"predicted_step_s": step, "ratio": run["step_s"] / step}
with open(out, "w") as f:
    json.dump(result, f, indent=1, default=str)
print(json.dumps({k: result.get(k) for k in ("id", "fits", "predicted_step_s", "ratio")}))
