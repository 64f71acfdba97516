"""The llm recipe: packed causal-LM data, a 2-step pulse, LoRA in the trainer (frozen base out of
the optimizer and checkpoints, refused on another base, exact resume, after kill -9 too in the
long form), and the Hugging Face / PEFT export loaded back by transformers with the same logits."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from helpers import family_tokenizer, long_form
from xlafit.check import check_recipe
from xlafit.check.program import ModelLever
from xlafit.check.recipes import memory_levers
from xlafit.checkpoint import Checkpointer, fingerprint
from xlafit.config import TrainerConfig
from xlafit.data import clm
from xlafit.errors import CheckpointError, ConfigError, DataError, HFFormatError
from xlafit.hf import llama as llama_hf
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.models.lora import ADAPTER, apply_lora, base_fingerprint, merge_lora
from xlafit.parallel.sharding import DEFAULT_RULES, activation_layout
from xlafit.recipes import llm as recipe
from xlafit.recipes import llm_data, load_config
from xlafit.recipes.base import shapes_only
from xlafit.runlock import LOCK

XLAFIT = [sys.executable, "-m", "xlafit"]


def run_files(run):
    """A run directory's files and their bytes, less its checkpoints and its lock (whose holder
    each attempt names)."""
    kept = (p for p in sorted(run.rglob("*")) if p.is_file() and "checkpoints" not in p.parts and p.name != LOCK)
    return {p: p.read_bytes() for p in kept}


TEXT = "\n\n".join(
    f"문서 {i}: 대한민국은 민주공화국이다. 모든 권력은 국민으로부터 나온다. 줄 {i} " * (1 + i % 4) for i in range(60)
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text corpus (60 documents) and a BPE tokenizer trained on it."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "text").mkdir()
    (d / "text" / "a.txt").write_text(TEXT)
    clm.train_bpe([str(d / "text" / "a.txt")], 300, d / "tok")
    return d


def env(cache):
    keep = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return keep | {"PYTHONUNBUFFERED": "1", "XLAFIT_CACHE": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}


# --------------------------------------------------------------------------- data


def test_an_evaluation_split_of_nothing_is_said_aloud(corpus, tmp_path):
    """One document at data.eval_fraction=0.1: nothing is drawn for evaluation, and the run
    says so instead of training without an eval loss unannounced."""
    from xlafit.recipes.llm_data import LlmDataConfig, data_summary

    one = tmp_path / "one.txt"
    one.write_text("A single document of a few words.")
    tok = clm.load_tokenizer(corpus / "tok")
    train, evaluation = clm.load_packed([str(one)], tok, seq_len=32, eval_fraction=0.1, seed=0)
    assert evaluation.documents == 0
    summary = data_summary(train, evaluation, LlmDataConfig(seq_len=32, eval_fraction=0.1))
    assert "no evaluation: none of the 1 document was drawn for it at data.eval_fraction=0.1" in summary
    assert "data.eval_fraction=0 to train without one" in summary
    assert "no evaluation" not in data_summary(train, evaluation, LlmDataConfig(seq_len=32, eval_fraction=0.0))


def test_packed_rows_keep_documents_apart(corpus):
    tok = clm.load_tokenizer(corpus / "tok")
    bos, eos = clm.special_ids(corpus / "tok")
    assert (bos, eos) == (0, 1)
    train, evaluation = clm.load_packed(
        [str(corpus / "text")], tok, seq_len=64, eval_fraction=0.2, seed=0, markers=(bos, eos)
    )
    assert train.documents + evaluation.documents == 60 and 0 < evaluation.documents < 30
    ids, seg, pos = (train.arrays[k] for k in ("input_ids", "segment_ids", "positions"))
    assert ids.shape[1] == 64 and train.vocab_size == tok.get_vocab_size()
    # positions restart at 0 where a segment starts; padding is segment 0 with the pad id
    starts = np.flatnonzero((seg[:, 1:] != seg[:, :-1]).ravel())
    assert (pos[seg > 0].min(), (ids[seg == 0] == tok.token_to_id(clm.PAD)).all()) == (0, True)
    first = pos[:, 0] == 0
    assert first.all() and len(starts) > 0
    targets, weights = clm.next_token_targets(ids, seg)
    # a weighted target is always the next token of the same segment, never padding or a new document
    assert ((seg[:, 1:] == seg[:, :-1])[weights > 0]).all() and (seg[:, 1:][weights > 0] > 0).all()
    assert ((seg[:, 1:] != seg[:, :-1]) & (weights > 0)).sum() == 0
    # every document starts with <s>; a whole one ends with </s>
    assert (ids[(pos == 0) & (seg > 0)] == bos).sum() >= train.documents
    # the same packing from Parquet (one document per row)
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = list(clm.read_documents([str(corpus / "text")]))
    pq.write_table(pa.table({"body": docs}), corpus / "docs.parquet")
    from_parquet, _ = clm.load_packed(  # a directory: its *.txt and *.parquet files
        [str(corpus)], tok, seq_len=64, eval_fraction=0.2, seed=0, text_column="body", markers=(bos, eos)
    )
    np.testing.assert_array_equal(from_parquet.arrays["input_ids"], ids)
    with pytest.raises(DataError, match="has no column 'text' .*set data.text_column"):
        clm.load_packed([str(corpus / "docs.parquet")], tok, seq_len=64)


def test_documents_and_tokenizer_in_a_bucket_pack_as_local_ones(corpus, gcs):
    from xlafit.data.text import expand_inputs
    from xlafit.io.paths import as_path

    b = gcs.bucket
    as_path(f"{b}/text/a.txt").write_text(TEXT)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        as_path(f"{b}/tok/{name}").write_text((corpus / "tok" / name).read_text())
    cfg = load_config("llm", [f"data.data_dir={b}/text", f"data.tokenizer={b}/tok", "data.seq_len=64"])
    train, evaluation = llm_data.load_data(cfg)
    assert clm.special_ids(f"{b}/tok") == clm.special_ids(corpus / "tok") == (0, 1)
    markers = clm.special_ids(corpus / "tok")
    local, _ = clm.load_packed([str(corpus / "text")], clm.load_tokenizer(corpus / "tok"), seq_len=64, markers=markers)
    np.testing.assert_array_equal(train.arrays["input_ids"], local.arrays["input_ids"])
    assert expand_inputs([f"{b}/text"]) == [f"{b}/text/a.txt"]  # a directory URL, as a local one
    llm_data.save_artifacts(cfg, as_path(f"{b}/run"), train)  # the run's copy, for the export
    assert as_path(f"{b}/run/tokenizer/tokenizer.json").read_text() == (corpus / "tok" / "tokenizer.json").read_text()


def test_config_errors_name_the_fix(corpus, tmp_path):
    with pytest.raises(ConfigError, match="data.data_dir needs a tokenizer: set data.tokenizer"):
        llm_data.load_data(load_config("llm", [f"data.data_dir={corpus / 'text'}"]))
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')  # a model's, not a tokenizer
    not_a_tokenizer = [f"data.data_dir={corpus / 'text'}", f"data.tokenizer={tmp_path}/config.json"]
    with pytest.raises(DataError, match=r"config.json is not a Hugging Face tokenizer.json \(.+\); give data"):
        llm_data.load_data(load_config("llm", not_a_tokenizer))
    for fraction in (1, 1.5, -0.5):  # all held out (nothing to train on), or a share that is none
        with pytest.raises(ConfigError, match=rf"data.eval_fraction={fraction} is the share of the data held out"):
            load_config("llm", [f"data.eval_fraction={fraction}"])
    with pytest.raises(ConfigError, match="data.seq_len=1024 is longer than the model's max_position_embeddings=512"):
        recipe.validate(load_config("llm", ["data.seq_len=1024"]))
    with pytest.raises(ConfigError, match="model.preset=custom needs model.num_layers"):
        recipe.validate(load_config("llm", ["model.preset=custom", "model.hidden_size=64"]))
    with pytest.raises(
        ConfigError, match="vocabulary of 128256; .* or model.preset=custom with model.vocab_size=200000"
    ):
        recipe.llama_config(load_config("llm", ["model.preset=llama-3.2-1b"]), 200000)
    custom = ["model.preset=custom", "model.num_layers=1", "model.hidden_size=64", "model.num_heads=4",
              "model.intermediate_size=128", "model.vocab_size=512"]  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"vocabulary of 512; use that model's tokenizer \(data.tokenizer\) or model.vocab"
    ):
        recipe.llama_config(load_config("llm", custom), 2000)
    big = load_config("llm", ["model.preset=llama-3.1-8b", "data.seq_len=4096"])
    per_row = recipe.throughput(big, clm.PackedText({"input_ids": np.zeros((1, 4096))}, 128256, 1))
    assert per_row["flops_per_example"] / 4096 == pytest.approx(51.5e9, rel=1e-3)  # LlamaConfig's doctest


# --------------------------------------------------------------------------- the pulse


def test_pulse_two_steps_of_the_demo(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    cfg = load_config(
        "llm",
        [
            f"run.run_dir={tmp_path / 'run'}",
            "trainer.stop_at_step=2",
            "trainer.log_every_steps=1",
            "data.vocab_size=500",
        ],
    )
    result = xlafit.train_and_evaluate(cfg)
    err = capsys.readouterr().err  # progress notes go to stderr: `xlafit check llm --json` stays JSON
    assert "trained the demo's BPE tokenizer" in err and int(result.state.step) == 2
    assert [r["step"] for r in result.history] == [1, 2]
    assert result.history[0]["loss"] == pytest.approx(np.log(500), abs=0.3)  # untrained: about uniform
    assert result.history[0]["mfu"] > 0 and result.history[0]["tokens_per_sec"] > 0
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").exists()


def test_a_resume_with_another_tokenizer_is_refused_and_the_run_is_left_as_it_was(corpus, tmp_path, capsys):
    """Another tokenizer of the same size fits the checkpoints' shapes but not their token ids:
    the resume rewrote config.yaml and tokenizer/ before it failed (or trained on), and the
    run's export then carried the other tokenizer."""
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(f"another corpus, line {i}: the quick brown fox jumps. " * 3 for i in range(80)))
    clm.train_bpe([str(other)], 300, tmp_path / "tok2")
    run = tmp_path / "run"
    common = [f"run.run_dir={run}", f"data.data_dir={corpus / 'text'}", "data.seq_len=32", "trainer.epochs=1",
              "data.global_batch=8", "model.preset=custom", "model.num_layers=1", "model.hidden_size=32",
              "model.num_heads=2", "model.intermediate_size=64", "optimizer.decay_steps=100"]  # fmt: skip
    xlafit.train_and_evaluate(load_config("llm", [*common, f"data.tokenizer={corpus / 'tok'}"]))
    before = run_files(run)
    final = [line for line in capsys.readouterr().out.splitlines() if line.startswith("test:")]
    assert len(final) == 1 and final[0].endswith(" rows)"), final  # rows of seq_len tokens, not records
    with pytest.raises(ConfigError) as refused:
        xlafit.train_and_evaluate(load_config("llm", [*common, f"data.tokenizer={tmp_path / 'tok2'}"]))
    assert str(refused.value).startswith(
        f"cannot resume {run}: its tokenizer/tokenizer.json differs from this run's tokenizer (data.tokenizer, else "
        "model.init_from_hf's); the checkpoints learned the run's token ids."
    )
    assert f"its own copy is {run}/tokenizer/tokenizer.json" in str(refused.value)
    assert "resuming with changed settings" not in capsys.readouterr().out
    after = run_files(run)
    assert after == before
    # The run's own tokenizer, given again (another copy of it): resumes.
    xlafit.train_and_evaluate(load_config("llm", [*common, f"data.tokenizer={run / 'tokenizer'}", "trainer.epochs=1"]))
    # A run whose tokenizer was replaced by hand after training: the export wrote config.json for
    # the new vocabulary beside the checkpoint's embeddings, which transformers cannot load.
    from xlafit.errors import CheckpointError
    from xlafit.export import export_hf

    clm.train_bpe([str(other)], 200, tmp_path / "tok3")
    (run / "tokenizer" / "tokenizer.json").write_text((tmp_path / "tok3" / "tokenizer.json").read_text())
    with pytest.raises(CheckpointError, match=r"embed_tokens.* is \(300, 32\), and the model the run's config.yaml"):
        export_hf(run, tmp_path / "hf")


def test_a_data_file_edited_in_place_is_named_on_resume_and_when_its_split_is_scored(corpus, tmp_path):
    """A run read its files again on resume: a record fixed or added in place moved every later
    row (and the held-out share) and the run trained on, its step N other examples. It keeps the
    sha256 of each file (data_files.json, names left out: moved data resumes); a resume on an
    edited file is refused, naming it, and the run is left as it was; scoring the run's own
    split compares the evaluation files alone."""
    import hashlib
    import shutil

    from xlafit.run_eval import evaluate_run

    data, held = tmp_path / "data", tmp_path / "held"
    data.mkdir(), held.mkdir()
    (data / "a.txt").write_text(TEXT)
    (held / "b.txt").write_text(TEXT[: len(TEXT) // 3])
    run = tmp_path / "run"
    common = [f"run.run_dir={run}", f"data.tokenizer={corpus / 'tok'}", "data.seq_len=32", "trainer.epochs=1",
              "data.global_batch=8", "model.preset=custom", "model.num_layers=1", "model.hidden_size=32",
              "model.num_heads=2", "model.intermediate_size=64", "optimizer.decay_steps=100",
              f"data.eval_data_dir={held / 'b.txt'}"]  # fmt: skip
    xlafit.train_and_evaluate(load_config("llm", [*common, f"data.data_dir={data}", "trainer.stop_at_step=2"]))
    sha = lambda path: hashlib.sha256(path.read_bytes()).hexdigest()  # noqa: E731
    recorded = json.loads((run / "data_files.json").read_text())
    assert recorded == {"train": [sha(data / "a.txt")], "eval": [sha(held / "b.txt")]}

    original = (data / "a.txt").read_bytes()
    (data / "a.txt").write_text(TEXT.replace("문서 7:", "문서 칠:"))  # one record fixed in place
    before = run_files(run)
    with pytest.raises(ConfigError) as refused:
        xlafit.train_and_evaluate(load_config("llm", [*common, f"data.data_dir={data}"]))
    assert str(refused.value).startswith(
        f"cannot resume {run}: its data_files.json differs from this run's data files (the sha256 of each file it "
        "trains and evaluates on): a file of data.data_dir or data.eval_data_dir was changed since the run started"
    )
    assert run_files(run) == before
    (score,) = evaluate_run(str(run))  # its evaluation file is as it was: scored
    assert score.step == 2
    (held / "b.txt").write_text(TEXT[: len(TEXT) // 2])
    with pytest.raises(ConfigError, match=r"cannot score .* on its own evaluation data: its data_files.json differs"):
        evaluate_run(str(run))

    # The same bytes elsewhere (the data moved): the run resumes and trains on.
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "a.txt").write_bytes(original)
    shutil.copy(held / "b.txt", moved / "b.txt")
    (held / "b.txt").write_text(TEXT[: len(TEXT) // 3])
    resumed = xlafit.train_and_evaluate(load_config("llm", [*common, f"data.data_dir={moved / 'a.txt'}"]))
    assert int(resumed.state.step) > 2


# --------------------------------------------------------------------------- LoRA in the trainer


def _tiny(seed=0, lora=True):
    model = LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=64), rngs=nnx.Rngs(seed))
    return apply_lora(model, ("q_proj", "v_proj"), rank=4, alpha=8, rngs=nnx.Rngs(1)) if lora else model


@pytest.mark.parametrize(
    "chunk, family",
    [(5, {}), (8, {"final_logit_softcap": 2.0, "tie_embeddings": True}), (64, {})],
)  # a chunk not dividing the 31 positions (Gemma 2's soft-cap on tied embeddings); one holding them all
def test_the_loss_in_blocks_is_the_loss_and_its_gradient(chunk, family):
    """model.logits_chunk: the same loss, accuracy and gradients, the logits a block at a time."""
    sizes = dict(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, max_position_embeddings=64
    )
    rng = np.random.default_rng(0)
    batch = {
        "input_ids": jnp.asarray(rng.integers(1, 97, (3, 32)), jnp.int32),
        "segment_ids": jnp.asarray(np.repeat([[1] * 12 + [2] * 14 + [0] * 6], 3, axis=0), jnp.int32),
        "positions": jnp.asarray(np.repeat([list(range(12)) + list(range(14)) + [0] * 6], 3, axis=0), jnp.int32),
    }
    results = []
    for logits_chunk in (0, chunk):
        model = LlamaForCausalLM(LlamaConfig(**sizes, **family, logits_chunk=logits_chunk), rngs=nnx.Rngs(0))

        def loss(m):
            value, metrics = recipe.loss_fn(m, batch)
            return value.mean(), metrics["token_accuracy"]

        # compiled: op by op, the blocks' scan and its backward pass take seconds per block
        (value, accuracy), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
        results.append((value, accuracy, jax.tree.leaves(nnx.state(grads))))
    (v0, a0, g0), (v1, a1, g1) = results
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    np.testing.assert_allclose(a1, a0, rtol=1e-6)
    for x, y in zip(g1, g0, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="logits_chunk=-1 must be auto, 0"):
        LlamaConfig(**sizes, logits_chunk=-1)


def test_a_lora_adapted_output_layer_is_the_kernel_of_the_loss_in_blocks():
    model = apply_lora(_tiny(lora=False), ("lm_head",), rank=2, alpha=4, rngs=nnx.Rngs(1))
    nnx.update(model, jax.tree.map(lambda b: b + 0.1, nnx.state(model, ADAPTER)))  # B starts at 0: move it
    x = jax.random.normal(jax.random.key(0), (2, 3, 64))
    np.testing.assert_allclose(x @ model.output_kernel(), model.logits(x), rtol=1e-5, atol=1e-6)


def test_auto_takes_blocks_where_the_whole_logits_would_be_a_large_share_of_memory(strategy8):
    """The rule: blocks where 2 x rows x seq_len x vocab x 4 bytes pass 1/8 of a device's memory
    (a CPU: 16 GiB assumed), the rows and vocabulary one device's."""
    big = LlamaConfig.preset("llama-3.1-8b")  # 128,256 tokens
    assert recipe.logits_blocks(big, rows=2, seq_len=8192) == (2048, 16128)  # 16.8 GB whole: tiles of the vocabulary
    assert recipe.logits_blocks(big, rows=1, seq_len=2048) is None  # 2.1 GB whole, under 1/8 of 16 GiB
    assert recipe.logits_blocks(dataclasses.replace(big, logits_chunk=0), rows=2, seq_len=8192) is None
    assert recipe.logits_blocks(dataclasses.replace(big, logits_chunk=512), rows=1, seq_len=2048) == (512, 128256)
    tiny = LlamaConfig.preset("tiny", vocab_size=2000)
    assert recipe.logits_blocks(tiny, rows=8, seq_len=256) is None
    # Traced under an 8-device mesh, 16 rows are 2 a device: the whole logits stay whole.
    with activation_layout(strategy8.mesh, DEFAULT_RULES):
        assert recipe.logits_blocks(big, rows=16, seq_len=1024) is None
    assert recipe.logits_blocks(big, rows=16, seq_len=1024) == (256, 16128)
    assert load_config("llm", []).model.logits_chunk == "auto"


@long_form(
    26,
    "test_logps_in_blocks.py::test_a_dpo_step_and_its_eval_hold_far_less_than_the_whole_logits_by_default (auto's "
    "blocks on the TPU compiler, train and eval steps, the same 2.1 GB of whole logits)",
)
def test_the_tpu_compiler_holds_less_than_the_whole_logits_by_default():
    """A tiny model with Gemma's 262,144-token vocabulary at 8 x 256 tokens a core: the whole
    logits alone are 2.1 GB (4.3 with their gradient, over 1/8 of a v5e's 16 GiB), so auto takes
    blocks; the TPU compiler's whole program, state and all, then needs less than those logits
    (3.5 GiB with the whole logits, 1.0 GiB in blocks of 256 MiB)."""
    settings = ["model.vocab_size=262144", "data.seq_len=256", "data.per_device_batch=8", "data.eval_global_batch=8"]
    (report,) = check_recipe("llm", settings, tpu="v5e-1").tpu
    assert report.fits and report.eval is not None and report.eval.fits
    logits = 8 * 255 * 262144 * 4
    assert report.memory["total"] < logits and report.eval.total < logits / 4


@pytest.mark.parametrize("value", ["auto", 0, 1024])
def test_logits_chunk_takes_auto_zero_or_a_number(value):
    assert load_config("llm", [f"model.logits_chunk={value}"]).model.logits_chunk == value


@pytest.mark.parametrize(
    "value, message",
    [
        ("-1", "model.logits_chunk=-1 must be auto, 0 (the whole logits at once) or a number of positions."),
        ("big", "model.logits_chunk='big' is not allowed: expected int or 'auto'."),
        ("true", "model.logits_chunk=True is not allowed: expected int or 'auto'."),
    ],
)
def test_a_wrong_logits_chunk_is_one_line(value, message):
    with pytest.raises(ConfigError) as e:
        load_config("llm", [f"model.logits_chunk={value}"])
    assert str(e.value) == message


def test_a_run_that_does_not_fit_is_offered_the_loss_in_chunks():
    for setting in ([], ["model.logits_chunk=0"]):
        offered = [lever.text for lever in memory_levers(load_config("llm", setting).model)]
        assert any("model.logits_chunk=1024" in text for text in offered)
    chunked = load_config("llm", ["model.logits_chunk=512"]).model
    assert not any("logits_chunk" in lever.text for lever in memory_levers(chunked))


def test_a_full_fine_tune_that_no_lever_fits_is_offered_lora_and_not_a_smaller_batch_at_one():
    """The sixteenth walk: Llama 3.2 1B's full fine-tune on a v5e core, one sequence a core, that
    no compiled lever fitted, was told "a smaller batch, a larger slice or a smaller model", and
    not LoRA, which the guide advises there."""
    from xlafit.check.program import LeverFit, TargetReport
    from xlafit.check.tpu_report import lever_lines

    offered = {lever.kind: lever.text for lever in memory_levers(load_config("llm", []).model, full=True)}
    assert offered["state"].startswith("LoRA on a frozen base: lora.rank=16")
    assert not any(lever.kind == "state" for lever in memory_levers(load_config("llm", []).model))  # LoRA: not offered
    # The twentieth walk: a LoRA run on a bfloat16 base over the core was offered chunked logits
    # first and no 4-bit base, the one lever its own compiled list then showed fitting.
    lora = load_config("llm", ["lora.rank=16", "lora.base_dtype=bfloat16"])
    nf4 = ModelLever("state", "a 4-bit frozen base: lora.base_dtype=nf4 (the adapters train as they are)")
    assert nf4 in memory_levers(lora.model, lora=lora.lora)
    quantized = load_config("llm", ["lora.rank=16", "lora.base_dtype=nf4"])
    assert not any(lever.kind == "state" for lever in memory_levers(quantized.model, lora=quantized.lora))
    said = {1: "none of these fits: a larger slice, a smaller model, or another lever listed above",
            4: "none of these fits: a smaller batch, a larger slice, a smaller model, or another lever"}  # fmt: skip
    for batch in said:
        r = TargetReport("v5e-1", train_fits=False, per_device_batch=batch)
        r.lever_fits = [LeverFit("the logits in chunks", ["model.logits_chunk=1024"], batch, fits=False, memory=2**34)]
        assert said[batch] in "\n".join(lever_lines(r))


def test_a_size_given_with_init_from_hf_that_differs_from_its_config_is_refused(tmp_path):
    """model.num_layers=6 with a 2-layer model.init_from_hf would be recorded and not used:
    refused, naming both; the checkpoint's own size, or none, passes."""
    llama_hf.save_hf(_tiny(lora=False), tmp_path / "hf")
    source = f"model.init_from_hf={tmp_path / 'hf'}"
    with pytest.raises(ConfigError) as e:
        recipe.validate(load_config("llm", [source, "model.num_layers=6"]))
    assert str(e.value) == (
        f"model.num_layers=6 conflicts with {source}, whose config.json has 2; its sizes are the checkpoint's: "
        "drop model.num_layers, or drop model.init_from_hf to train a new model of that size."
    )
    demo = "data.vocab_size=64"  # a model made for the demo's tokenizer of that size
    recipe.validate(load_config("llm", [source, "model.num_layers=2", demo]))
    recipe.validate(load_config("llm", [source, demo]))


def test_a_local_checkpoint_that_cannot_serve_the_run_is_refused_before_the_run_directory(tmp_path):
    """A family xlafit does not read was named only after the run directory was written (and,
    with --restart, the earlier run moved aside); data.seq_len beyond the checkpoint's
    positions trained on without a word (a new model's is refused)."""
    llama_hf.save_hf(_tiny(lora=False), tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 300}))
    with pytest.raises(ConfigError, match=r"model.init_from_hf=.*gpt2: config.json describes a 'gpt2' model; xlafit"):
        recipe.validate(load_config("llm", [f"model.init_from_hf={tmp_path / 'gpt2'}", "data.seq_len=32"]))
    with pytest.raises(
        ConfigError, match=r"data.seq_len=128 is longer than model.init_from_hf=.*'s max_position_embeddings=64"
    ):
        recipe.validate(load_config("llm", [f"model.init_from_hf={tmp_path / 'llama'}", "data.seq_len=128"]))
    recipe.validate(
        load_config("llm", [f"model.init_from_hf={tmp_path / 'llama'}", "data.seq_len=64", "data.vocab_size=64"])
    )


def test_a_checkpoint_without_its_tokenizer_is_not_trained_on_the_demos(tmp_path):
    """A model saved without its tokenizer (save_pretrained of the model alone) trained on the
    demo corpus tokenized by xlafit's demo tokenizer, token ids the model never learned, without a
    word: refused before the run directory, unless the run names a tokenizer or the demo's size."""
    llama_hf.save_hf(_tiny(lora=False), tmp_path / "hf")
    source = f"model.init_from_hf={tmp_path / 'hf'}"
    for demo in ("korean", "chat"):
        with pytest.raises(ConfigError) as e:
            recipe.validate(load_config("llm", [source, f"data.demo={demo}"]))
        assert str(e.value).startswith(f"{source} has no tokenizer.json, so the run would tokenize its data with ")
        assert "data.tokenizer=org/name" in str(e.value)
    with shapes_only():  # a check compiles for shapes: any tokenizer of the size serves
        recipe.validate(load_config("llm", [source]))
    (tmp_path / "hf" / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(ConfigError, match=r"only a sentencepiece tokenizer.model, which xlafit does not read"):
        recipe.validate(load_config("llm", [source]))
    tokenizer = family_tokenizer("llama3", tmp_path / "tokenizer")
    recipe.validate(load_config("llm", [source, f"data.tokenizer={tokenizer}"]))
    recipe.validate(load_config("llm", [source, "data.vocab_size=64"]))
    (tmp_path / "hf" / "tokenizer.json").write_bytes((tokenizer / "tokenizer.json").read_bytes())
    recipe.validate(load_config("llm", [source]))


def _lm_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["x"][:, 1:]).mean(-1)


def test_lora_trains_the_adapters_alone_and_checkpoints_no_base(tmp_path, strategy8):
    data = {"x": (np.arange(32 * 16).reshape(32, 16) * 7 % 61).astype(np.int32)}

    def trainer(build, epochs, run_dir):
        config = TrainerConfig(epochs=epochs, log_every_steps=0)
        return xlafit.Trainer(
            build, _lm_loss, optax.adam(1e-2), strategy=strategy8, global_batch=16, config=config,
            run_dir=run_dir, trainable=ADAPTER,
        )  # fmt: skip

    t = trainer(_tiny, 1, tmp_path / "run")
    up = lambda state: np.asarray(state.model_state["layers"][0]["mlp"]["up_proj"]["kernel"][...])  # noqa: E731
    before = up(t.state)  # a host copy: fit donates the state
    adapters = jax.tree.leaves(t.state.params)
    assert len(adapters) == 8  # lora_a, lora_b of q and v in 2 layers: nothing else differentiated
    assert sum(x.size for x in jax.tree.leaves(t.state.opt_state)) == 2 * sum(x.size for x in adapters) + 1
    t.fit(data)
    t.close()
    # the base did not move (bit for bit), the adapters did
    np.testing.assert_array_equal(up(t.state), before)
    assert float(jnp.abs(t.state.params["layers"][0]["self_attn"]["q_proj"]["lora_b"][...]).max()) > 0
    # the checkpoint holds the adapters, their optimizer state and the step: no base weights
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    saved = ckpt.restore_arrays(ckpt.latest_step())
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(saved)[0]]
    assert not [n for n in names if "kernel" in n or "embedding" in n or "scale" in n]
    assert ckpt.saved_metadata(ckpt.latest_step()) == {
        "base_fingerprint": t.base_fingerprint,
        "global_batch": "16",
        "data_seed": "0",
    }
    ckpt.close()
    # the same base resumes, exactly: the adapters and their Adam moments of a run that never
    # stopped, bit for bit (the base is rebuilt, not restored; adapters drawn from another seed
    # are replaced by the checkpoint's); another base is refused, naming both fingerprints
    other_adapters = lambda: apply_lora(_tiny(lora=False), ("q_proj", "v_proj"), rank=4, alpha=8, rngs=nnx.Rngs(2))  # noqa: E731
    again = trainer(other_adapters, 2, tmp_path / "run")
    resumed = again.fit(data).state
    again.close()
    whole = trainer(_tiny, 2, tmp_path / "whole")
    uninterrupted = whole.fit(data).state
    whole.close()
    assert int(resumed.step) == int(uninterrupted.step) == 4
    end = lambda state: fingerprint((state.params, state.opt_state))  # noqa: E731
    assert end(resumed) == end(uninterrupted)
    other = trainer(lambda: _tiny(seed=5), 3, tmp_path / "run")
    with pytest.raises(
        CheckpointError, match=f"fingerprint {again.base_fingerprint}, this run's base {other.base_fingerprint}"
    ):
        other.fit(data)
    other.close()


def test_lora_config_builds_adapters_on_a_bfloat16_base():
    from xlafit.config import LoraConfig
    from xlafit.models.lora import BASE
    from xlafit.run import with_lora

    model = with_lora(_tiny(lora=False), LoraConfig(rank=4, targets="q_proj, o_proj", base_dtype="bfloat16"), seed=0)
    dtypes = lambda f: {x.dtype for x in jax.tree.leaves(nnx.state(model, f))}  # noqa: E731
    assert (dtypes(BASE), dtypes(ADAPTER)) == ({jnp.dtype(jnp.bfloat16)}, {jnp.dtype(jnp.float32)})
    ids = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    # Compiled: op by op, the mixed-dtype backward takes many times longer on a loaded CPU.
    grads = nnx.jit(nnx.grad(lambda m: _lm_loss(m, {"x": ids}).mean(), argnums=nnx.DiffState(0, ADAPTER)))(model)
    assert np.isfinite(float(nnx.jit(_lm_loss)(model, {"x": ids}).mean())) and len(jax.tree.leaves(grads)) == 8
    assert jax.tree.leaves(nnx.state(with_lora(_tiny(lora=False), LoraConfig(rank=0), seed=0), ADAPTER)) == []
    with pytest.raises(ConfigError, match="no nnx.Linear named query in the model .*named: down_proj, gate_proj"):
        with_lora(_tiny(lora=False), LoraConfig(rank=4, targets="query"), seed=0)
    with pytest.raises(ConfigError, match="lora.targets is empty"):
        LoraConfig(rank=4, targets=" , ")


@pytest.mark.parametrize(
    "overrides, tied, error",
    [
        # one unknown name beside a known one: refused too, not dropped
        (["lora.targets=q_proj,qproj"], False, r"no nnx.Linear named qproj in the model .*named: down_proj, gate_proj"),
        (["lora.targets=q_proj,lm_head"], True,
         r"named lm_head .* ties its output layer to its embedding \(tie_word_embeddings\), so lm_head is no"),
        (["lora.alpha=0"], False, r"lora.alpha=0 must be positive: .* at 0 nothing trains"),
        (["lora.alpha=-8"], False, r"lora.alpha=-8 must be positive"),
        (["lora.targets="], False, r"lora.targets is empty \(given as lora.targets= or null\); give it a value"),
    ],
    ids=["unknown-beside-known", "tied-lm-head", "alpha-0", "alpha-negative", "targets-empty"],
)  # fmt: skip
def test_lora_settings_that_would_train_other_layers_or_nothing_are_refused(overrides, tied, error):
    from xlafit.run import with_lora

    model = LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=64, tie_embeddings=tied), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match=error):
        with_lora(model, load_config("llm", ["lora.rank=4", *overrides]).lora, seed=0)


def _segment(cmd, cache):
    """Starts ``cmd``; returns the process and an event set at its first [train] line."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(cache))
    seen, lines = threading.Event(), []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[train] step 3 "):
                seen.set()
        seen.set()

    threading.Thread(target=read, daemon=True).start()
    return proc, seen, lines


def _final(run_dir):
    ckpt = Checkpointer(run_dir / "checkpoints")
    step = ckpt.latest_step()
    saved = ckpt.restore_arrays(step)
    ckpt.close()
    return step, fingerprint({"params": saved["params"], "opt_state": saved["opt_state"]})


@long_form(
    56,
    "test_lora_trains_the_adapters_alone_and_checkpoints_no_base (a LoRA run stopped and resumed: the "
    "uninterrupted adapters and moments) and test_preemption's kill -9 loop",
)
def test_lora_run_killed_with_sigkill_resumes_exactly(tmp_path):
    cache = tmp_path / "cache"
    cmd = lambda run: [  # noqa: E731
        *XLAFIT, "train", "llm", "--simulate", "2", "--run-dir", str(run),
        "lora.rank=4", "lora.targets=q_proj,v_proj,down_proj", "data.vocab_size=400", "data.seq_len=64",
        "data.global_batch=16", "trainer.stop_at_step=8", "trainer.log_every_steps=1",
        "trainer.checkpoint_every_steps=1", "trainer.eval_every_epochs=100",
    ]  # fmt: skip
    whole = subprocess.run(cmd(tmp_path / "whole"), capture_output=True, text=True, env=env(cache), timeout=300)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    proc, seen, lines = _segment(cmd(tmp_path / "cut"), cache)
    seen.wait(timeout=300)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "".join(lines)[-3000:]
    resumed = subprocess.run(cmd(tmp_path / "cut"), capture_output=True, text=True, env=env(cache), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from checkpoint" in resumed.stdout
    assert _final(tmp_path / "cut") == _final(tmp_path / "whole")
    assert _final(tmp_path / "whole")[0] == 8


# --------------------------------------------------------------------------- export


def _logits_ours(model, ids):
    return np.asarray(model(jnp.asarray(ids)))


# peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing (not our code)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_export_loads_in_transformers_and_peft_with_the_same_logits(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from xlafit.export import export_hf

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    common = ["trainer.stop_at_step=2", "data.vocab_size=400", "data.seq_len=64", "trainer.eval_every_epochs=100"]
    xlafit.train_and_evaluate(load_config("llm", [f"run.run_dir={tmp_path / 'full'}", *common]))
    export_hf(tmp_path / "full", tmp_path / "full-hf")
    lora = [
        f"model.init_from_hf={tmp_path / 'full-hf'}",
        "lora.rank=4",
        "lora.alpha=8",
        "lora.targets=q_proj,v_proj,lm_head",
    ]
    lora.append("optimizer.learning_rate=0.05")
    xlafit.train_and_evaluate(load_config("llm", [f"run.run_dir={tmp_path / 'lora'}", *common, *lora]))
    export_hf(tmp_path / "lora", tmp_path / "lora-hf")

    ids = np.array([[0, 5, 17, 42, 99, 7, 300, 12], [0, 250, 3, 3, 8, 150, 77, 1]], np.int64)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "lora-hf")
    assert tok.convert_tokens_to_ids("<s>") == 0 and len(tok("대한민국").input_ids) > 0

    def hf_logits(model):
        with torch.no_grad():
            return model(torch.from_numpy(ids)).logits.float().numpy()

    # the full run: transformers reads what our model computes
    full = llama_hf.from_hf(tmp_path / "full-hf")
    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full-hf", dtype=torch.float32)
    np.testing.assert_allclose(hf_logits(merged_hf), _logits_ours(full, ids), atol=1e-4, rtol=1e-4)
    # the LoRA run: our model with its trained adapters = the merged export = PEFT on the base
    from xlafit.hf.peft import load_peft_adapter

    ours = load_peft_adapter(llama_hf.from_hf(tmp_path / "full-hf"), tmp_path / "lora-hf" / "adapter")
    expected = _logits_ours(ours, ids)
    assert np.abs(expected - _logits_ours(full, ids)).max() > 1e-3  # the adapters learned something
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lora-hf", dtype=torch.float32)
    np.testing.assert_allclose(hf_logits(merged), expected, atol=1e-4, rtol=1e-4)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full-hf", dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "lora-hf" / "adapter")
    np.testing.assert_allclose(hf_logits(with_adapter), expected, atol=1e-4, rtol=1e-4)
    config = json.loads((tmp_path / "lora-hf" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "full-hf").absolute())
    assert config["target_modules"] == ["lm_head", "q_proj", "v_proj"]
    assert base_fingerprint(merge_lora(ours)) != base_fingerprint(full)  # merged: another model


def test_an_export_replaces_an_earlier_one_whole_and_refuses_other_folders(tmp_path, monkeypatch, capsys):
    """Exporting a full run over an earlier LoRA export left its adapter/ behind, and the
    summary named it as written; --out inside the run mixed HF files into it; a file as --out
    was a FileExistsError."""
    from xlafit.cli import main

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    run, out = tmp_path / "run", tmp_path / "hf"
    common = ["trainer.stop_at_step=1", "data.vocab_size=300", "data.seq_len=32", "trainer.eval_every_epochs=100"]
    xlafit.train_and_evaluate(load_config("llm", [f"run.run_dir={run}", *common]))
    (out / "adapter").mkdir(parents=True)  # an earlier export, of a LoRA run
    (out / "adapter" / "adapter_config.json").write_text("{}")
    (out / "xlafit-config.yaml").write_text("recipe: llm\n")
    capsys.readouterr()
    assert main(["export", "hf", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    (earlier,) = tmp_path.glob("hf-before-export-*")
    assert f"the earlier export in {out} was moved to {earlier}" in printed
    assert (earlier / "adapter" / "adapter_config.json").exists() and not (out / "adapter").exists()
    summary = printed.splitlines()[-1]
    assert summary.startswith(f"exported checkpoint 1 of {run} to {out}: config.json, ") and "adapter" not in summary
    assert {name.rstrip(",") for name in summary.split(": ", 1)[1].split()} == {p.name for p in out.iterdir()}
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("mine")
    (tmp_path / "file.txt").write_text("mine")
    for where, says in [
        (run / "hf", f"--out {run / 'hf'} is inside the run directory {run}; give a folder outside it."),
        (run, f"--out {run} is inside the run directory {run}"),
        (tmp_path / "file.txt", f"--out {tmp_path / 'file.txt'} is a file; give a directory"),
        (tmp_path / "notes", f"--out {tmp_path / 'notes'} holds files that are not an xlafit export"),
    ]:
        assert main(["export", "hf", str(run), "--out", str(where)]) == 2
        assert says in capsys.readouterr().err
    assert (tmp_path / "notes" / "README.md").read_text() == "mine" and not (run / "hf").exists()
    assert (tmp_path / "file.txt").read_text() == "mine"


def test_missing_or_damaged_checkpoint_files_are_named_before_the_run_directory(tmp_path):
    """A truncated model.safetensors (an interrupted download) raised safetensors' own
    SafetensorError after the data was read and the run directory written, and a config.json
    that is not JSON was reported without its file; a folder with no config.json or no weights
    was named only when the model was built. Each is refused by validate, naming the file."""
    good = tmp_path / "good"
    llama_hf.save_hf(_tiny(lora=False), good)

    def refusal(name, damage):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        damage(folder)
        with pytest.raises(ConfigError) as e:
            recipe.validate(load_config("llm", [f"model.init_from_hf={folder}", "data.seq_len=32"]))
        return str(e.value)

    def truncate(path):
        path.write_bytes(path.read_bytes()[:1000])

    assert re.search(r"good2/model.safetensors is damaged \(.*header.*\); download or export it again",
                     refusal("good2", lambda d: truncate(d / "model.safetensors")))  # fmt: skip
    assert re.search(r"config.json is not valid JSON \(line 1, column 2: .*\); download or export it again",
                     refusal("badjson", lambda d: (d / "config.json").write_text("{bad")))  # fmt: skip
    assert "has neither model.safetensors nor model.safetensors.index.json" in refusal(
        "noweights", lambda d: (d / "model.safetensors").unlink()
    )
    assert "has no config.json" in refusal("noconfig", lambda d: (d / "config.json").unlink())
    truncate(good / "model.safetensors")
    with pytest.raises(HFFormatError, match="model.safetensors is damaged"):
        llama_hf.from_hf(good)  # what generate reads


def test_a_preset_with_fewer_or_more_layers_keeps_its_layer_pattern():
    """`model.preset=gemma-3-1b model.num_layers=2` (a smaller model of the family, to try a
    setting fast) was refused: "layer_types has 26 entries for 2 layers". The preset's repeating
    block is laid out again for the layers asked for."""
    from xlafit.models.llama_config import PRESETS
    from xlafit.recipes.llm import llama_config

    block = PRESETS["gemma-3-1b"]["layer_types"][:6]
    assert block.count("full_attention") == 1 and block[-1] == "full_attention"  # five sliding, one global
    for layers in (2, 6, 8, 30):
        cfg = llama_config(load_config("llm", ["model.preset=gemma-3-1b", f"model.num_layers={layers}"]), 262_144)
        assert cfg.layer_types == tuple(block[i % 6] for i in range(layers))
    assert llama_config(load_config("llm", ["model.preset=gemma-3-1b"]), 262_144).layer_types == tuple(
        PRESETS["gemma-3-1b"]["layer_types"]
    )


def test_a_tokenizer_without_an_eos_token_is_said_to_leave_the_model_unable_to_stop(tmp_path, caplog):
    """The twenty-second walk: data.tokenizer a folder with tokenizer.json alone (the docs accept
    it) trained every completion without an end token, the run saying nothing."""
    import logging

    tokenizer = family_tokenizer("xlafit", tmp_path / "family")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "tokenizer.json").write_bytes((tokenizer / "tokenizer.json").read_bytes())
    records = "".join(json.dumps({"prompt": f"What is {i}?", "completion": f" It is {i}."}) + "\n" for i in range(40))
    (tmp_path / "pc.jsonl").write_text(records)
    data = [f"data.data_dir={tmp_path / 'pc.jsonl'}", "data.seq_len=32", "model.preset=tiny"]
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        llm_data.load_data(load_config("llm", [*data, f"data.tokenizer={tmp_path / 'bare'}"]))
    said = [r.getMessage() for r in caplog.records if "names no eos_token" in r.getMessage()]
    assert len(said) == 1 and "the model does not learn to stop" in said[0], [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        llm_data.load_data(load_config("llm", [*data, f"data.tokenizer={tokenizer}"]))  # its config names </s>
    assert not [r for r in caplog.records if "names no eos_token" in r.getMessage()]


def test_a_chat_template_or_text_column_the_data_leaves_unused_is_said_to_be_ignored(tmp_path, caplog):
    """The twenty-second walk: data.chat_template on text, and data.text_column on records,
    did nothing without a word (other settings the data leaves unused are named)."""
    import logging

    tokenizer = family_tokenizer("xlafit", tmp_path / "tok")
    (tmp_path / "notes.txt").write_text("\n\n".join(f"Note {i}: the answer is short." for i in range(40)))
    records = "".join(json.dumps({"prompt": f"What is {i}?", "completion": f" It is {i}."}) + "\n" for i in range(40))
    (tmp_path / "pc.jsonl").write_text(records)
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    common = [f"data.tokenizer={tokenizer}", "data.seq_len=32", "model.preset=tiny"]
    cases = [
        (
            [f"data.data_dir={tmp_path / 'notes.txt'}", f"data.chat_template={tmp_path / 't.jinja'}"],
            "data.chat_template=",
        ),
        ([f"data.data_dir={tmp_path / 'pc.jsonl'}", "data.text_column=body"], "data.text_column=body set, but the"),
        # prompt/completion text: TRL applies no template to it either
        (
            [f"data.data_dir={tmp_path / 'pc.jsonl'}", f"data.chat_template={tmp_path / 't.jinja'}"],
            "but the data is prompt/completion text",
        ),
    ]
    for settings, said in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="xlafit"):
            llm_data.load_data(load_config("llm", [*common, *settings]))
        assert [r.getMessage() for r in caplog.records if said in r.getMessage()], [
            r.getMessage() for r in caplog.records
        ]
    # Conversational prompt/completion records are rendered in the template: nothing said
    turns = [
        {
            "prompt": [{"role": "user", "content": f"What is {i}?"}],
            "completion": [{"role": "assistant", "content": f"{i}"}],
        }
        for i in range(40)
    ]
    (tmp_path / "cpc.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        llm_data.load_data(
            load_config(
                "llm",
                [*common, f"data.data_dir={tmp_path / 'cpc.jsonl'}", f"data.chat_template={tmp_path / 't.jinja'}"],
            )
        )
    assert not [r for r in caplog.records if "data.chat_template=" in r.getMessage()]
