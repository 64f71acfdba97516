"""The LLM guide's fit rows for Gemma 3 1B and Qwen3 1.7B from this folder's `xlafit check
--json` outputs (run.sh): HBM per core at one 2,048-token sequence per core, and the step
model's prediction with its band (a prediction, not a measurement)."""

import json
from pathlib import Path

here = Path(__file__).parent


def cell(t: dict) -> str:
    gib = (t["memory"].get("total") or 0) / 2**30
    if not t["fits"]:
        return f"no: {gib:.1f} GiB (state {t['memory'].get('state', 0) / 2**30:.1f})"
    band = f" ±{t['band_median']:.0%}" if t.get("band_median") is not None else ""
    return f"fits: {gib:.1f} GiB; {t['step_s'] * 1e3:.0f} ms{band}, {t['tokens_per_s']:,.0f} tokens/s"


rows = ["| model | training | v5e-1 (Colab) | v5e-8 (Kaggle), FSDP 8 |", "|---|---|---|---|"]
for model in ("gemma-3-1b", "qwen3-1.7b"):
    for mode in ("full", "lora"):
        path = here / f"{model}-{mode}-2048.json"
        text = path.read_text() if path.exists() else ""
        if "{" not in text:  # not run, or still running
            continue
        report = json.loads(text[text.index("{") :])
        label = "full (AdamW, f32 state)" if mode == "full" else "LoRA r16 (bf16 base)"
        rows.append(f"| {model} | {label} | {' | '.join(cell(t) for t in report['tpu'])} |")
print("\n".join(rows))
