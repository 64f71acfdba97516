"""Host memory while a safetensors checkpoint is read into a 4-bit (NF4) base for QLoRA.

Writes a checkpoint of random bfloat16 weights shaped like a preset (one shard per decoder
layer, so the writer itself holds one layer), then loads it with
``xlafit.hf.quantized.from_hf_quantized`` in a process of its own, after JAX has started and
the quantizing program compiled for each kernel shape, and reports the resident memory just
before loading and the peak while loading (``VmHWM``, reset through ``/proc/self/clear_refs``;
Linux), against the bound ``1.5 x the quantized model + the largest tensor``.

    python benchmarks/qlora/memory.py --preset llama-3.2-1b --dir /tmp/qlora-1b --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from xlafit.hf import config_json
from xlafit.hf import llama as llama_hf
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM

PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np
    from xlafit.hf.quantized import from_hf_quantized
    from xlafit.models.quantized import param_bytes, quantize_kernel
    for shape in json.loads(sys.argv[2]):
        quantize_kernel(np.zeros(shape, np.float32), "nf4", 64)
    before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    model = from_hf_quantized(sys.argv[1], "nf4")
    seconds = time.perf_counter() - start
    peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"rss_before": before, "peak_rss": peak, "quantized_bytes": param_bytes(model),
                      "load_seconds": seconds}))
    """
)


def write_checkpoint(cfg: LlamaConfig, out: Path) -> dict[str, int]:
    """Random bfloat16 weights of ``cfg``'s shapes as Hugging Face files, a shard per layer."""
    out.mkdir(parents=True, exist_ok=True)
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    groups: dict[str, dict[str, tuple]] = {}
    for name, param, row, t in llama_hf.entries(model):
        key = name.split(".")[2] if name.startswith("model.layers.") else "other"
        groups.setdefault(key, {})[name] = llama_hf._hf_shape(param, row, t)
    rng = np.random.default_rng(0)
    weight_map, total, largest = {}, 0, 0
    for i, shapes in enumerate(groups.values()):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: (rng.standard_normal(s, np.float32) * 0.02).astype(ml_dtypes.bfloat16) for n, s in shapes.items()}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        for name, value in tensors.items():
            weight_map[name] = file
            total += value.nbytes
            largest = max(largest, value.nbytes)
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / llama_hf.INDEX).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps({**config_json.hf_config(cfg), "torch_dtype": "bfloat16"}))
    return {"checkpoint_bytes": total, "largest_tensor_bytes": largest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--dir", type=Path, required=True, help="where the checkpoint is written")
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args()
    cfg = LlamaConfig.preset(args.preset)
    written = write_checkpoint(cfg, args.dir)
    h, m = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    shapes = json.dumps(sorted({(h, q), (h, kv), (q, h), (h, m), (m, h)}))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", PROBE, str(args.dir), shapes], capture_output=True, text=True,
                         env=env, check=True)  # fmt: skip
    measured = json.loads(out.stdout.splitlines()[-1])
    grew = measured["peak_rss"] - measured["rss_before"]
    bound = 1.5 * measured["quantized_bytes"] + written["largest_tensor_bytes"]
    result = {
        "preset": args.preset,
        "command": " ".join(["python", *sys.argv]),
        **written,
        **measured,
        "grew_bytes": grew,
        "bound_bytes": bound,
        "grew_over_quantized_after_largest_tensor": (grew - written["largest_tensor_bytes"])
        / measured["quantized_bytes"],
        "within_bound": grew <= bound,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
