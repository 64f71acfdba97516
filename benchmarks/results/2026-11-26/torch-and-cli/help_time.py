"""Median of 5 wall-clock runs of `python -m xlafit --help` (and `train --help`), a checkout of
0296a0e (its src/ given as the argument) against this tree: python help_time.py OLD/src"""

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
rows = {}
for args in (["--help"], ["train", "--help"]):
    for label, env in (("before (0296a0e)", old), ("after", None)):
        median, times = median_time([sys.executable, "-m", "xlafit", *args], env)
        rows[f"{label}: python -m xlafit {' '.join(args)}"] = {
            "median_s": round(median, 4),
            "runs_s": [round(t, 4) for t in times],
        }
print(json.dumps(rows, indent=2))
