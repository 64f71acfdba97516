"""A scanned candidate's FLOPs, HBM bytes and collectives as `xlafit plan` predicts them (from
unscanned 2- and 4-layer programs) beside its unscanned twin's own, for a 6-layer tiny BERT,
DP 2 x FSDP 2 on a v4-8, 8 per core; and what the scanned program's own cost analysis says.

    JAX_PLATFORMS=cpu python benchmarks/tpu/scan_cost.py OUT_DIR [TARGET]   # writes OUT_DIR/scan-cost-TARGET.json
"""

import dataclasses
import json
import sys
from pathlib import Path

from xlafit.check.tpu import no_persistent_cache
from xlafit.plan import recipe_planner
from xlafit.plan.candidates import Candidate
from xlafit.plan.cost import program_cost
from xlafit.plan.search import Settings
from xlafit.platform.hardware import parse_target

overrides = [
    "data.source=synthetic",
    "model.preset=tiny",
    "model.num_layers=6",
    "data.seq_len=64",
    "data.max_predictions=10",
    "trainer.steps_per_call=1",
]
planner, _, _ = recipe_planner("bert", overrides, None, Settings())
out_dir = Path(sys.argv[1])
target = parse_target(sys.argv[2] if len(sys.argv) > 2 else "v4-8")
flat = Candidate(target.name, (2, 2, 1) if target.num_devices == 4 else (2, 4, 1), 8, remat="none", scan=False)
scanned = dataclasses.replace(flat, scan=True)
with no_persistent_cache():
    planner._map([(target, flat, "layout"), (target, scanned, "layout")])
    raw, _ = planner.steps(target, scanned).compile_train(8)
a, b = planner.outcomes[flat], planner.outcomes[scanned]
rows = {}
for name, o in (("unscanned", a), ("scanned", b)):
    rows[name] = {
        "flops": o.flops,
        "memory_s": o.prediction.memory_s,
        "comm_bytes": sum(r["bytes"] for r in o.comms.by_kind.values()),
        "hbm_used": o.hbm_used,
        "compile_s": o.compile_s,
        "cost_compile_s": o.cost_compile_s,
    }
rows["scanned_raw_xla"] = dict(zip(("flops", "bytes"), program_cost(raw, scanned, 1, raw.as_text()), strict=True))
rows["command"] = f"JAX_PLATFORMS=cpu python benchmarks/tpu/scan_cost.py {out_dir} {target.name}"
out = out_dir / f"scan-cost-{target.name}.json"
out.write_text(json.dumps(rows, indent=1) + "\n")
print(json.dumps(rows, indent=1))
