"""Static shapes: padding, buckets, packing, the planner, and the recompile guard."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from xlafit.config import TrainerConfig
from xlafit.data.shapes import (
    BucketedDataset,
    bucket_batches,
    compare_plans,
    pack,
    pad_batch,
    padded_tokens,
    plan_buckets,
    round_up,
)
from xlafit.errors import DataError, RecompileError
from xlafit.models.bert import BertConfig, BertForMaskedLM
from xlafit.train.losses import masked_mean


def test_planner_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(150):
        lengths = rng.integers(1, 60, rng.integers(1, 25))
        k, multiple = int(rng.integers(1, 5)), int(rng.choice([1, 8]))
        got = plan_buckets(lengths, k, multiple)
        candidates = np.unique(round_up(lengths, multiple))
        best = min(
            padded_tokens(lengths, [*subset, candidates[-1]])
            for r in range(k)
            for subset in itertools.combinations(candidates[:-1], r)
        )
        assert padded_tokens(lengths, got) == best, (lengths, k, multiple, got)
        assert len(got) <= k and got[-1] >= lengths.max() and all(b % multiple == 0 for b in got)


def test_planner_beats_multiples_at_the_same_shape_count():
    lengths = np.random.default_rng(1).lognormal(3.5, 0.7, 5000).astype(int) + 2
    plans = {p.name: p for p in compare_plans(lengths)}
    for k in (32, 64):
        multiple = plans[f"multiple of {k}"]
        planned = plans[f"planned, {multiple.shapes} shapes"]
        assert planned.padded_tokens <= multiple.padded_tokens
    assert plans["pad to max"].waste > plans["multiple of 32"].waste


def test_pad_batch_and_buckets():
    out = pad_batch([[1, 2, 3], [4]], multiple=8)
    assert out["input_ids"].shape == (2, 8) and out["attention_mask"].sum() == 4
    with pytest.raises(DataError, match="does not fit length 2"):
        pad_batch([[1, 2, 3]], length=2)
    seqs = [list(range(1, n + 1)) for n in np.random.default_rng(2).integers(1, 40, 101)]
    seen = []
    for batch in bucket_batches(seqs, [8, 16, 40], batch_size=16):
        assert batch["input_ids"].shape[1] in (8, 16, 40) and batch["input_ids"].shape[0] == 16
        for row, i in zip(batch["input_ids"], batch["index"], strict=True):
            if i >= 0:
                assert row[: len(seqs[i])].tolist() == seqs[i] and not row[len(seqs[i]) :].any()
        seen += [int(i) for i in batch["index"] if i >= 0]
        assert np.array_equal(batch["example_mask"], (batch["index"] >= 0).astype(np.float32))
    assert sorted(seen) == list(range(101))  # every example exactly once


def test_packed_rows_compute_what_each_sequence_computes_alone():
    cfg = BertConfig.preset("tiny", vocab_size=100, max_position_embeddings=32)
    model = BertForMaskedLM(cfg, rngs=nnx.Rngs(0))
    model.eval()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(5, 100, n).tolist() for n in (5, 9, 3, 12, 7, 2)]
    packed = pack(seqs, 16)
    assert len(packed["input_ids"]) < len(seqs)
    forward = nnx.jit(lambda m, *args, **kwargs: m(*args, **kwargs))  # op by op, each length takes seconds
    logits = forward(
        model,
        jnp.asarray(packed["input_ids"]),
        jnp.asarray((packed["segment_ids"] > 0).astype(np.int32)),
        position_ids=jnp.asarray(packed["positions"]),
        segment_ids=jnp.asarray(packed["segment_ids"]),
    )
    for s, (row, start) in zip(seqs, packed["placement"], strict=True):
        alone = forward(model, jnp.asarray([s]))[0]
        np.testing.assert_allclose(logits[row, start : start + len(s)], alone, atol=2e-5)
    with pytest.raises(DataError, match="more than seq_len=4"):
        pack([[1] * 5], 4)


class MeanPool(nnx.Module):
    """Embeddings averaged over the valid tokens, then a linear classifier."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(50, 8, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, ids, mask):
        return self.out(masked_mean(self.embed(ids), mask[..., None].astype(jnp.float32), axis=1))


def seq_loss(model, batch):
    logits = model(batch["input_ids"], batch["attention_mask"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])


def test_masked_loss_on_buckets_equals_unpadded_loss():
    model = MeanPool(nnx.Rngs(0))
    rng = np.random.default_rng(3)
    seqs = [rng.integers(1, 50, n).tolist() for n in rng.integers(1, 30, 40)]
    labels = rng.integers(0, 3, 40)
    for batch in bucket_batches(seqs, plan_buckets([len(s) for s in seqs], 3), batch_size=8):
        losses = seq_loss(model, {**batch, "label": labels[np.maximum(batch["index"], 0)]})
        for i, loss in zip(batch["index"], losses, strict=True):
            if i >= 0:
                alone = seq_loss(
                    model,
                    {
                        "input_ids": jnp.asarray([seqs[i]]),
                        "attention_mask": jnp.ones((1, len(seqs[i])), jnp.int32),
                        "label": jnp.asarray([labels[i]]),
                    },
                )
                assert float(loss) == pytest.approx(float(alone[0]), abs=1e-5)


def bucketed_data(n=512):
    rng = np.random.default_rng(4)
    seqs = [rng.integers(1, 50, k).tolist() for k in rng.integers(2, 60, n)]
    boundaries = plan_buckets([len(s) for s in seqs], 3)
    return BucketedDataset(seqs, boundaries, extra={"label": rng.integers(0, 3, n)}), boundaries


def pool_trainer(strategy, **config):
    return xlafit.Trainer(
        MeanPool(nnx.Rngs(0)),
        seq_loss,
        optax.adam(1e-2),
        strategy=strategy,
        global_batch=32,
        config=TrainerConfig(**config),
    )


def test_variable_length_training_compiles_exactly_k_times(strategy8):
    data, boundaries = bucketed_data()
    trainer = pool_trainer(strategy8, epochs=2, log_every_steps=5)
    result = trainer.fit(data)
    assert result.train_compiles == len(boundaries) == 3
    assert trainer.train_step.max_compiles == 3  # the default: the planned shapes
    assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_unplanned_recompile_stops_naming_the_input(strategy8):
    data, _ = bucketed_data()
    trainer = pool_trainer(strategy8, epochs=1, max_compiles=2)
    with pytest.raises(
        RecompileError,
        match=r"program #3, over trainer.max_compiles=2: .*input_ids \[1, 32, \d+\]:int32 -> \[1, 32, \d+\]",
    ):
        trainer.fit(data)
    # arrays of one shape: a second shape is unplanned by default
    trainer = pool_trainer(strategy8, epochs=1)
    trainer.fit(
        {
            "input_ids": np.ones((64, 10), np.int32),
            "attention_mask": np.ones((64, 10), np.int32),
            "label": np.zeros(64, np.int32),
        }
    )
    state = trainer.state
    batch = {
        "input_ids": np.ones((1, 32, 12), np.int32),
        "attention_mask": np.ones((1, 32, 12), np.int32),
        "label": np.zeros((1, 32), np.int32),
    }
    with pytest.raises(RecompileError, match=r"input_ids \[1, 32, 10\]:int32 -> \[1, 32, 12\]:int32"):
        trainer.train_step(state, jax.tree.map(jnp.asarray, batch))


def test_compilation_cache_is_on(tmp_path, monkeypatch):
    from xlafit.io.cache import enable_compilation_cache

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    before = jax.config.jax_compilation_cache_dir
    try:
        assert enable_compilation_cache() == tmp_path / "jax"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jax")
        monkeypatch.setenv("XLAFIT_COMPILE_CACHE", "0")
        assert enable_compilation_cache() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
