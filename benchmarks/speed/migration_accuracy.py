"""MNIST test accuracy of docs/guides/migration.md's NNX program (3) and torch program (4), on
the whole embedded split; the torch one five times (its init is not seeded). From the repository
root, it prints the JSON:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu PYTHONPATH=src \
        python benchmarks/speed/migration_accuracy.py > OUT.json
"""

import contextlib
import io
import json
import re
import statistics
import sys

sys.path.insert(0, "tests")
import test_migration_guide  # noqa: E402


def test_accuracy(index: int) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(test_migration_guide.programs()[index], f"program {index + 1}", "exec"), {"__name__": "__main__"})
    return float(re.findall(r"test accuracy: ([0-9.]+)", out.getvalue())[-1])


nnx = test_accuracy(2)
torch_runs = [test_accuracy(3) for _ in range(5)]
result = {
    "data": "embedded MNIST, 4000 train / 1000 test",
    "epochs": 1,
    "optimizer": "adadelta(1.0)",
    "global_batch": 128,
    "devices": "8 simulated CPU devices, 2-core VM",
    "nnx_mnist_cnn_test_accuracy": nnx,
    "torch_net_via_xlafit_test_accuracy_runs": torch_runs,
    "torch_net_median": statistics.median(torch_runs),
}
print(json.dumps(result, indent=2))
