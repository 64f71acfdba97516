"""The fit table of the llm recipe from this folder's `xlafit check --json` outputs (run.sh)."""

import json
from pathlib import Path

here = Path(__file__).parent


def cell(t: dict) -> str:
    gib = (t["memory"].get("total") or 0) / 2**30
    if t["fits"]:
        refused = min((p["per_device_batch"] for p in t["probes"] if not p["fits"]), default=None)
        above = f" ({refused} does not)" if refused is not None else ""
        return f"fits: {gib:.1f} GiB at 1; largest **{t['max_batch']}**{above}"
    state = t["memory"].get("state", 0) / 2**30
    return f"no: {gib:.1f} GiB at 1 (state {state:.1f})"


rows = ["| model | training | tokens | v5e-1 (Colab) | v5e-8 (Kaggle), FSDP 8 |", "|---|---|---:|---|---|"]
for model in ("llama-3.2-1b", "llama-3.1-8b"):
    for mode in ("full", "lora"):
        for seq in (2048, 8192):
            path = here / f"{model}-{mode}-{seq}.json"
            if not path.exists():
                continue
            text = path.read_text()
            if "{" not in text:  # still running
                continue
            report = json.loads(text[text.index("{") :])  # a note may precede the JSON
            cells = [cell(t) for t in report["tpu"]]
            label = "full (AdamW, f32 state)" if mode == "full" else "LoRA r16 (bf16 base)"
            rows.append(f"| {model} | {label} | {seq:,} | {' | '.join(cells)} |")
print("\n".join(rows))
