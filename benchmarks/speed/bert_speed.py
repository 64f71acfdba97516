"""BERT masked-LM training speed: xlafit against Hugging Face transformers (PyTorch), one run.

Every row trains the same BERT (same sizes, batch, sequence length, AdamW + clipping, the
same masked batches from xlafit's masker) in a fresh process; rows are interleaved round by
round and the table shows the median of the repeats. Steps after the warm-up are timed
between two device syncs, the input pipeline (host-side masking, transfer) included.

Rows:
  xlafit            the recipe's step: MLM head at the max_predictions masked positions (original BERT)
  xlafit-full-head  the head at every position, like Hugging Face's BertForMaskedLM
  hf                transformers.BertForMaskedLM, PyTorch eager, SDPA attention

Commands (BENCHMARKS.md):
  .venv/bin/python benchmarks/speed/bert_speed.py --preset mini --batch 32 --dtype float32     # 2-core CPU
  python benchmarks/speed/bert_speed.py --preset base --batch 256 --dtype bfloat16             # H100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

MAX_PREDICTIONS = 20


def synthetic(examples: int, seq_len: int, vocab: int, seed: int = 0):
    """Full-length sequences of random tokens as an MLMDataset (masks drawn per batch)."""
    from xlafit.data.mlm import CLS, SEP, MaskingConfig, MLMDataset

    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, (examples, seq_len), dtype=np.int32)
    ids[:, 0], ids[:, -1] = CLS, SEP
    arrays = {
        "input_ids": ids,
        "token_type_ids": np.zeros_like(ids, dtype=np.int8),
        "length": np.full(examples, seq_len, np.int32),
    }
    return MLMDataset(arrays, vocab, MaskingConfig(max_predictions=MAX_PREDICTIONS))


def bert_sizes(args):
    from xlafit.models.bert import PRESETS

    return PRESETS[args.preset]


def run_xlafit(args, full_head: bool) -> dict:
    import jax
    import optax
    from flax import nnx

    import xlafit
    from xlafit.config import TrainerConfig
    from xlafit.models.bert import BertConfig, BertForMaskedLM
    from xlafit.recipes import bert as recipe
    from xlafit.train.losses import masked_mean

    cfg = BertConfig(
        **bert_sizes(args),
        vocab_size=args.vocab,
        dtype=args.dtype,
        attention=args.attention,
        hidden_dropout=args.dropout,
        dropout_bits=args.dropout_bits,
    )
    model = BertForMaskedLM(cfg, rngs=nnx.Rngs(params=0, dropout=1))

    def full_head_loss(model, batch):
        logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])  # (B, T, V)
        shape, positions = batch["input_ids"].shape, batch["masked_positions"]
        rows = jax.numpy.arange(shape[0])[:, None]
        labels = jax.numpy.zeros(shape, jax.numpy.int32).at[rows, positions].set(batch["masked_ids"])
        weights = jax.numpy.zeros(shape).at[rows, positions].set(batch["masked_weights"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return masked_mean(losses, weights)

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, eps=1e-6, weight_decay=0.01))
    from xlafit.recipes import load_config

    strategy = xlafit.connect(cpu=load_config("bert").cpu)  # the recipe's CPU setting
    trainer = xlafit.Trainer(
        model,
        full_head_loss if full_head else recipe.loss_fn,
        tx,
        strategy=strategy,
        global_batch=args.batch,
        config=TrainerConfig(epochs=1, steps_per_call=args.steps_per_call),
    )
    data = synthetic(args.batch * (args.warmup + args.steps), args.seq_len, args.vocab)
    total = args.warmup + args.steps
    # The trainer's own dispatch loop (Trainer.steps, which Trainer.fit runs): at most two
    # calls in flight. Timed from the end of the warm-up to the last call's completion.
    t0, wait0, metrics = time.perf_counter(), 0.0, None
    for call in trainer.steps(data, 0, total):
        metrics = call.metrics
        if call.first + call.k == args.warmup:
            jax.block_until_ready(metrics)  # note: host-device sync, the warm-up's work done
            t0, wait0 = time.perf_counter(), call.wait_s
        wait_s = call.wait_s
    jax.block_until_ready(trainer.state)
    seconds = time.perf_counter() - t0
    if args.profile:  # a few more steps under the profiler, outside the timed window
        with jax.profiler.trace(args.profile, create_perfetto_trace=True):
            for _call in trainer.steps(data, 0, 5):
                pass
            jax.block_until_ready(trainer.state)
    return {
        "seconds": seconds,
        "input_wait_s": wait_s - wait0,
        "compile_s": trainer.train_step.compile_s,
        "loss": float(jax.device_get(metrics["loss"])[-1]),
        "device": str(jax.devices()[0].device_kind),
        "versions": {"jax": jax.__version__, "flax": __import__("flax").__version__},
    }


def run_hf(args) -> dict:
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(os.cpu_count() or 1)
    sizes = bert_sizes(args)
    config = transformers.BertConfig(
        vocab_size=args.vocab,
        hidden_size=sizes["hidden_size"],
        num_hidden_layers=sizes["num_layers"],
        num_attention_heads=sizes["num_heads"],
        intermediate_size=sizes["intermediate_size"],
        attention_probs_dropout_prob=0.0,  # as xlafit's preset: keeps SDPA's fused kernels
        hidden_dropout_prob=args.dropout,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6, weight_decay=0.01, fused=cuda)
    data = synthetic(args.batch * (args.warmup + args.steps), args.seq_len, args.vocab)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def batch_at(step):
        b = data.take(np.arange(step * args.batch, (step + 1) * args.batch))
        labels = np.full(b["input_ids"].shape, -100, np.int64)
        rows = np.arange(args.batch)[:, None]
        keep = b["masked_weights"] > 0
        labels[np.broadcast_to(rows, keep.shape)[keep], b["masked_positions"][keep]] = b["masked_ids"][keep]
        t = lambda x: torch.from_numpy(np.asarray(x, np.int64)).to(device, non_blocking=True)  # noqa: E731
        return t(b["input_ids"]), t(b["attention_mask"]), t(b["token_type_ids"]), t(labels)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    loss = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            t0 = time.perf_counter()
        ids, mask, types, labels = batch_at(step)
        with autocast:
            loss = model(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    return {
        "seconds": time.perf_counter() - t0,
        "input_wait_s": None,
        "compile_s": 0.0,
        "loss": float(loss),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def worker(args) -> None:
    if args.worker == "hf":
        out = run_hf(args)
    else:
        out = run_xlafit(args, full_head=args.worker == "xlafit-full-head")
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto")
    p.add_argument("--dropout", type=float, default=0.1, help="hidden dropout, both rows")
    p.add_argument("--dropout-bits", type=int, choices=(16, 32), default=16, help="xlafit rows' dropout draw")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps-per-call", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default="xlafit,xlafit-full-head,hf")
    p.add_argument("--json", help="write every run and the table here")
    p.add_argument("--profile", metavar="DIR", help="trace 5 xlafit steps (Perfetto JSON + XPlane) into DIR")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    from xlafit.models.bert import BertConfig
    from xlafit.platform.hardware import peak_flops

    rows = args.rows.split(",")
    runs: dict[str, list[dict]] = {r: [] for r in rows}
    forwarded = []  # the worker's arguments: ours, less --json and its value
    skip = False
    for a in sys.argv[1:]:
        if not skip and not a.startswith("--json"):
            forwarded.append(a)
        skip = a == "--json"
    for repeat in range(args.repeats):
        for row in rows:
            cmd = [sys.executable, __file__, *forwarded, "--worker", row]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                sys.exit(f"{row} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
            result = json.loads(lines[-1][len("RESULT ") :])
            runs[row].append(result)
            tokens = args.batch * args.seq_len * args.steps / result["seconds"]
            wait = result["input_wait_s"]
            print(
                f"round {repeat + 1}/{args.repeats} {row:<17} {tokens:>10,.0f} tokens/s"
                + (f"  input wait {100 * wait / result['seconds']:.1f}%" if wait is not None else ""),
                flush=True,
            )

    import jax

    cfg = BertConfig(**bert_sizes(args), vocab_size=args.vocab)
    flops_per_seq = cfg.train_flops_per_sequence(args.seq_len, MAX_PREDICTIONS)
    peak, source = peak_flops(jax.devices()[:1])
    first = None
    table = []
    print(
        f"\nBERT {args.preset} {cfg.num_layers}L/{cfg.hidden_size}H, seq {args.seq_len}, batch {args.batch}, "
        f"{args.dtype}, vocab {args.vocab}; {args.steps} timed steps after {args.warmup}, median of {args.repeats}"
    )
    print(
        f"MFU: model FLOPs ({flops_per_seq / 1e9:.3f} GFLOP/sequence, head at {MAX_PREDICTIONS} positions) "
        f"over {peak / 1e12:.4g} TFLOP/s ({source})"
    )
    print(f"{'row':<17} {'step ms':>9} {'tokens/s':>11} {'MFU %':>7} {'compile s':>10} {'vs hf':>7}")
    hf_tokens = None
    if "hf" in runs:
        hf_tokens = args.batch * args.seq_len * args.steps / statistics.median(r["seconds"] for r in runs["hf"])
    for row, rs in runs.items():
        seconds = statistics.median(r["seconds"] for r in rs)
        tokens = args.batch * args.seq_len * args.steps / seconds
        mfu = args.batch * args.steps * flops_per_seq / seconds / peak
        ratio = tokens / hf_tokens if hf_tokens else None
        first = first or tokens
        table.append(
            {
                "row": row,
                "step_ms": 1000 * seconds / args.steps,
                "tokens_per_sec": tokens,
                "mfu": mfu,
                "speedup_vs_hf": ratio,
                "compile_s": statistics.median(r["compile_s"] for r in rs),
            }
        )
        print(
            f"{row:<17} {1000 * seconds / args.steps:>9.1f} {tokens:>11,.0f} {100 * mfu:>7.1f} "
            f"{table[-1]['compile_s']:>10.1f} {f'{ratio:.2f}x' if ratio else '-':>7}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "peak_flops": peak,
                    "peak_source": source,
                    "table": table,
                    "runs": runs,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": platform.platform(),
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
