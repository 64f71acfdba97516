"""The five stored H200 steps predicted with the H200's calibration instead of the built-in
row: as written, with its matrix rate refitted by today's fit, and with the datasheet's vector
rate as well. FOLDER holds the calibration (``calibration.json``, ``calibrate.json``); writes
FOLDER/calibrated_steps.json. From the repository root:

    PYTHONPATH=src python benchmarks/predict/calibrated_steps.py benchmarks/results/2026-11-28/gpu-predict
"""

import dataclasses
import json
import sys
from pathlib import Path

from xlafit.predict.calibrate import _possible
from xlafit.predict.fit import fit_matmul, fit_stream
from xlafit.predict.rates import load_rates
from xlafit.predict.validation import gpu_checks

HERE = Path(sys.argv[1])
row = load_rates(HERE / "calibration.json")[0]
record = json.loads((HERE / "calibrate.json").read_text())["record"]
bandwidth, _ = fit_stream(record["stream"])
kept, _ = _possible(record["matmul"] + record.get("matmul_left_out", []), row.device_kind)
flops, tile = fit_matmul(kept, row.units, bandwidth=bandwidth)
refit = dataclasses.replace(row, matmul_flops=flops, matmul_tile=tile)
variants = {
    "as written": row,
    "matrix rate refitted": refit,
    "and the datasheet vector rate": dataclasses.replace(refit, vector_ops_per_s=33.5e12),
}
out = {}
for name, rates in variants.items():
    checks = gpu_checks(Path("benchmarks/validation/gpu-h200"), rates)
    out[name] = {
        "matmul_flops": rates.matmul_flops,
        "tile": list(rates.matmul_tile),
        "vector_ops_per_s": rates.vector_ops_per_s,
        "errors": {c.id: c.error for c in checks},
    }
    print(name, f"{rates.matmul_flops / 1e12:.0f} TFLOP/s", {c.id: f"{c.error:+.1%}" for c in checks})
(HERE / "calibrated_steps.json").write_text(json.dumps(out, indent=1) + "\n")
