"""How a prepared masked-LM split reaches training: read into memory (xlafit before the
cache) against decoded once into memory-mapped ``.npy`` files (now), each in a fresh
process: seconds to load, and the process's resident memory after loading and after
drawing batches as the trainer does.

    .venv/bin/python benchmarks/mlm_load.py --sequences 2000000

The split is synthetic (random ids, 128 tokens a sequence), written by xlafit's own shard
writer; its cache goes to a temporary ``XLAFIT_CACHE``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np


def write_split(url: str, sequences: int, seq_len: int, vocab: int) -> None:
    from xlafit.data import mlm

    rng = np.random.default_rng(0)
    writer = mlm._ShardWriter(*_local(url), "train", seq_len, 65536)
    for start in range(0, sequences, 65536):
        rows = rng.integers(5, vocab, (min(65536, sequences - start), seq_len))
        for row in rows.tolist():
            writer.add(row, [0] * seq_len)
    writer.flush()
    manifest = {
        "format": mlm.FORMAT,
        "seq_len": seq_len,
        "tokenizer": {"vocab_size": vocab},
        "splits": {
            "train": {
                "sequences": sequences,
                "tokens": sequences * seq_len,
                "shards": writer.shards,
            }
        },
    }
    with open(f"{url}/{mlm.MANIFEST}", "w") as f:
        json.dump(manifest, f)


def _local(url: str):
    import fsspec

    return fsspec.filesystem("file"), url


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def worker(url: str, memory_map: bool, batches: int) -> None:
    from xlafit.data import mlm

    start = time.perf_counter()
    arrays, _ = mlm.load_split(url, "train", memory_map=memory_map)
    loaded = time.perf_counter() - start
    after_load = rss_mb()
    dataset = mlm.MLMDataset(arrays, 30522)
    rng = np.random.default_rng(1)
    start = time.perf_counter()
    for _ in range(batches):
        dataset.take(np.sort(rng.choice(len(dataset), 256, replace=False)))
    per_batch = (time.perf_counter() - start) / batches
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"load_s": loaded, "rss_mb": after_load, "peak_mb": peak, "batch_ms": per_batch * 1e3}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=2_000_000)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1] == "mmap", args.batches)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"{tmp}/data"
        os.makedirs(url)
        start = time.perf_counter()
        write_split(url, args.sequences, 128, 30522)
        print(f"wrote {args.sequences:,} sequences in {time.perf_counter() - start:.0f} s", flush=True)
        env = {**os.environ, "XLAFIT_CACHE": f"{tmp}/cache", "JAX_PLATFORMS": "cpu"}
        run = lambda mode: json.loads(  # noqa: E731
            subprocess.run(
                [sys.executable, __file__, "--worker", url, mode, "--batches", str(args.batches)],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout.splitlines()[-1]
        )
        results = {"in memory": [], "mmap, first run (decodes)": [run("mmap")], "mmap, later runs": []}
        for _ in range(args.repeats):
            results["in memory"].append(run("memory"))
            results["mmap, later runs"].append(run("mmap"))
        print(f"{'':28s} {'load s':>8s} {'RSS after load MB':>18s} {'peak RSS MB':>12s} {'batch of 256 ms':>16s}")
        for name, runs in results.items():
            med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
            row = f"{med['load_s']:8.2f} {med['rss_mb']:18.0f} {med['peak_mb']:12.0f} {med['batch_ms']:16.2f}"
            print(f"{name:28s} {row}")


if __name__ == "__main__":
    main()
