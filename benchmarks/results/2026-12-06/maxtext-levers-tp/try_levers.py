import sys, json
sys.path.insert(0, "benchmarks/predict")
import tpu_published as tp
from xlafit.platform.hardware import parse_targets
from xlafit.predict.rates import rates_for
from xlafit.predict.model import predict
runs = {r["id"]: r for r in json.loads((tp.HERE / "runs.json").read_text())["runs"]}
run = runs[sys.argv[1]]
levers = sys.argv[2:]
target = parse_targets(run["target"])[0]
record, hlo = tp.compile_at(run, run["batch"], levers)
print(json.dumps({k: record.get(k) for k in ("fits", "needs", "compile_s", "memory")}))
if hlo:
    step = predict(hlo, rates_for(target.generation.device_kinds[0]), target.ici_bandwidth, target.num_devices).seconds
    print("step", step, "ratio", (run["batch"] * run["seq"] / step) / (run["batch"] * run["seq"] / run["step_s"]))
