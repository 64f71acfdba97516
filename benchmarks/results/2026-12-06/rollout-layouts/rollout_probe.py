"""`xlafit check llm --tpu kaggle --json ARGS` that also writes each rollout program's optimised HLO:
`python rollout_probe.py OUT_DIR key=value ...` (the JSON on stdout, the HLO in OUT_DIR)."""

import pathlib
import sys

import xlafit.check.tpu as tpu
from xlafit.cli import main

out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
price = tpu.price


def keep(fit, compiled, *args, **kwargs):
    (out / f"{fit.name.replace(' ', '_')}.hlo").write_text(compiled.as_text())
    return price(fit, compiled, *args, **kwargs)


tpu.price = keep
sys.exit(main(["check", "llm", "--tpu", "kaggle", "--json", *sys.argv[2:]]))
