"""How a prepared masked-LM split reaches training: read into memory (xlafit before the
cache) against decoded once into memory-mapped ``.npy`` files (now), each in a fresh
process: seconds to load, and the process's resident memory after loading and after
drawing batches as the trainer does (its own memory and the mapped file pages
apart).

    .venv/bin/python benchmarks/speed/mlm_load.py --sequences 2000000

The split is synthetic (random ids, 128 tokens a sequence), written by xlafit's own shard
writer; its cache goes to a temporary ``XLAFIT_CACHE``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def write_split(url: str, sequences: int, seq_len: int, vocab: int) -> None:
    import fsspec

    from xlafit.data import mlm
    from xlafit.data.mlm.preparation import _ShardWriter

    rng = np.random.default_rng(0)
    writer = _ShardWriter(fsspec.filesystem("file"), url, "train", seq_len, 65536)
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


def rss_mb() -> dict[str, float]:
    """Resident memory: anonymous (the process's own) and file-backed (memory-mapped file
    pages, which the kernel drops under pressure and reads again when touched)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile")}


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
    after = rss_mb()
    print(
        json.dumps(
            {
                "load_s": loaded,
                "anon_mb": after_load["RssAnon"],
                "anon_end_mb": after["RssAnon"],
                "file_end_mb": after["RssFile"],
                "batch_ms": per_batch * 1e3,
            }
        )
    )


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
        columns = {"load_s": "load s", "anon_mb": "own MB, loaded", "anon_end_mb": "own MB, end"}
        columns |= {"file_end_mb": "mapped file MB, end", "batch_ms": "ms a batch"}
        print(f"{'median of runs':28s}" + "".join(f"{c:>21s}" for c in columns.values()))
        for name, runs in results.items():
            print(f"{name:28s}" + "".join(f"{np.median([r[k] for r in runs]):21.2f}" for k in columns))


if __name__ == "__main__":
    main()
