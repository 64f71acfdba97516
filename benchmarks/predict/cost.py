"""What the step model adds to a compile: the time to read a compiled program's kernels from
its text and price them, against the compile itself (the TPU compiler on this machine); the
text itself (``as_text``, which check and plan read anyway) is timed apart.

    JAX_PLATFORMS=cpu python benchmarks/predict/cost.py TARGET RECIPE PER_CORE_BATCH [overrides ...] [--json FILE]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from xlafit.check import recipe_program
from xlafit.check.tpu import Steps, no_persistent_cache
from xlafit.platform.hardware import parse_targets
from xlafit.predict.model import predict
from xlafit.predict.ops import kernels
from xlafit.predict.rates import rates_for


def main() -> None:
    args = sys.argv[1:]
    out = None
    if "--json" in args:
        i = args.index("--json")
        out, args = args[i + 1], args[:i] + args[i + 2 :]
    name, recipe, batch, *overrides = args
    target = parse_targets(name)[0]
    program = recipe_program(recipe, overrides)[0]
    program.eval_global_batch = None
    with no_persistent_cache():
        steps = Steps(target, program)
        compiled, compile_s = steps.compile_train(int(batch))
    rates = rates_for(target.generation.device_kinds[0])
    assert rates is not None
    t0 = time.perf_counter()
    text = compiled.as_text()  # check and plan read it anyway (the roofline, the collectives)
    as_text_s = time.perf_counter() - t0
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        found = kernels(text)
        step = predict(found, rates, target.ici_bandwidth, target.num_devices)
        runs.append(time.perf_counter() - t0)
    if "XLAFIT_KEEP_HLO" in __import__("os").environ:  # for profiling the reader
        with open(__import__("os").environ["XLAFIT_KEEP_HLO"], "w") as f:
            f.write(text)
    result = {
        "target": name,
        "recipe": recipe,
        "per_core_batch": int(batch),
        "overrides": overrides,
        "compile_s": compile_s,
        "as_text_s": as_text_s,
        "predict_s_runs": runs,
        "predict_s_median": statistics.median(runs),
        "hlo_chars": len(text),
        "kernels": len(found),
        "steps_per_call": program.config.steps_per_call,
        "predicted_step_s": step.seconds / program.config.steps_per_call,
    }
    print(json.dumps(result, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
