import dataclasses
import sys
import time

from xlafit.check import recipe_program
from xlafit.check.tpu import Steps, memory_of, no_persistent_cache
from xlafit.parallel.cluster import start_backends
from xlafit.platform import hardware as tpu
from xlafit.train.step import WEIGHT

start_backends()
target, seq, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
settings = [
    "model.preset=gemma-3-1b",
    "model.num_layers=2",
    "model.vocab_size=4096",
    f"data.seq_len={seq}",
    "model.compute_dtype=bfloat16",
    "model.remat=full",
    "model.scan_layers=false",
    "mesh.data=1",
    "mesh.fsdp=-1",
    "data.per_device_batch=1",
    "data.global_batch=null",
    *extra,
]
program = dataclasses.replace(recipe_program("llm", settings)[0], eval_global_batch=None)


def mean(model, batch):
    loss, metrics = program.loss_fn(model, batch)
    return loss, {k: v for k, v in metrics.items() if k != WEIGHT}


for name, p in (("weighted", program), ("mean", dataclasses.replace(program, loss_fn=mean))):
    t = time.time()
    with no_persistent_cache():
        steps = Steps(tpu.parse_target(target), p)
        compiled, _ = steps.compile_train(1)
    print(
        name,
        memory_of(compiled, steps.state_bytes, 0)["temporaries"] / 2**20,
        "MiB",
        round(time.time() - t, 1),
        "s",
        flush=True,
    )
