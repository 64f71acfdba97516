"""Training tokens/s on this CPU: the llm recipe's tiny Llama through xlafit's train step
against transformers' LlamaForCausalLM in PyTorch eager, same shapes, same weights, same run.

    JAX_PLATFORMS=cpu python benchmarks/speed/llm_tokens.py OUT.json

One device (one process, both cores), batch 32 x 128 tokens, vocabulary 2,000 (the demo's
tokenizer), AdamW; 10 warm-up steps, then 5 rounds of 20 timed steps, xlafit and torch
interleaved round by round. xlafit: the jitted step of xlafit.train.step.build_train_step (the
trainer's step) with the recipe's loss; torch: forward + cross-entropy + backward + AdamW.
A record, not a target: the CPU is for rehearsal. Writes OUT.json.
"""

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import transformers
from flax import nnx

from xlafit.hf.config_json import hf_config
from xlafit.hf.llama import to_hf_state
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.recipes.llm import loss_fn
from xlafit.train.state import TrainState
from xlafit.train.step import build_train_step

BATCH, SEQ, VOCAB, WARMUP, STEPS, ROUNDS = 32, 128, 2000, 10, 20, 5

cfg = LlamaConfig.preset("tiny", vocab_size=VOCAB)
model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
rng = np.random.default_rng(0)
ids = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
batch = {
    "input_ids": ids,
    "segment_ids": np.ones_like(ids),
    "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), ids.shape).copy(),
}

# xlafit: the trainer's pure step, one step per call.
tx = optax.adamw(1e-3)
model.train()
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rest)
step = jax.jit(build_train_step(graphdef, loss_fn, tx), donate_argnums=0)
stacked = jax.tree.map(lambda x: jnp.asarray(x)[None], batch)

# torch: the same weights in transformers' model.
hf = transformers.LlamaConfig(**hf_config(cfg))
peer = transformers.LlamaForCausalLM(hf)
peer.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in to_hf_state(model).items()}, strict=False)
peer.train()
opt = torch.optim.AdamW(peer.parameters(), lr=1e-3)
tids = torch.from_numpy(ids.astype(np.int64))


def run_xlafit(n: int) -> float:
    global state
    t0 = time.perf_counter()
    for _ in range(n):
        state, metrics = step(state, stacked)
    jax.block_until_ready(metrics)
    return time.perf_counter() - t0


def run_torch(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        loss = peer(input_ids=tids, labels=tids).loss
        loss.backward()
        opt.step()
    return time.perf_counter() - t0


run_xlafit(WARMUP)
run_torch(WARMUP)
rates: dict[str, list[float]] = {"xlafit": [], "torch-eager": []}
for _ in range(ROUNDS):
    rates["xlafit"].append(STEPS * BATCH * SEQ / run_xlafit(STEPS))
    rates["torch-eager"].append(STEPS * BATCH * SEQ / run_torch(STEPS))
result = {
    "command": f"JAX_PLATFORMS=cpu python benchmarks/speed/llm_tokens.py {sys.argv[1]}",
    "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
    "shapes": {"batch": BATCH, "seq": SEQ, "vocab": VOCAB, "model": "tiny (2 x 64, 4 heads, 2 kv heads)"},
    "tokens_per_s": {k: v for k, v in rates.items()},
    "median": {k: statistics.median(v) for k, v in rates.items()},
    "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
}
result["ratio_xlafit_over_torch"] = result["median"]["xlafit"] / result["median"]["torch-eager"]
Path(sys.argv[1]).write_text(json.dumps(result, indent=2))
print(json.dumps(result["median"]), f"ratio {result['ratio_xlafit_over_torch']:.2f}")
