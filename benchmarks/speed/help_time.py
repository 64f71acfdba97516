"""Median of 5 wall-clock runs of `python -m xlafit --help` (and `train --help`), an older
checkout (its src/ given as the argument) against this tree; prints the JSON:

    PYTHONPATH=src python benchmarks/speed/help_time.py OLD/src [OLD_LABEL] > OUT.json
"""

import json
import os
import statistics
import subprocess
import sys
import time


def median_time(cmd: list[str], env: dict | None, n: int = 5) -> tuple[float, list[float]]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, env=env, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


old = {**os.environ, "PYTHONPATH": sys.argv[1]}
old_label = sys.argv[2] if len(sys.argv) > 2 else sys.argv[1]
rows = {}
for args in (["--help"], ["train", "--help"]):
    for label, env in ((f"before ({old_label})", old), ("after", None)):
        median, times = median_time([sys.executable, "-m", "xlafit", *args], env)
        rows[f"{label}: python -m xlafit {' '.join(args)}"] = {
            "median_s": round(median, 4),
            "runs_s": [round(t, 4) for t in times],
        }
print(json.dumps(rows, indent=2))
