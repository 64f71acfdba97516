"""`xlafit check --tpu` compiles the levers that would make a run fit (xlafit.check.lever_fits),
with the real TPU compiler (libtpu) on this CPU: tiny programs made not to fit by their
logits (an 8,208,384-token vocabulary at 8 sequences a core) or by their frozen base."""

import dataclasses
import json

import pytest

from helpers import SMALL_LLM
from xlafit.check.lever_fits import fit_levers
from xlafit.check.program import FitLever, Probe
from xlafit.check.recipes import fit_levers_of, recipe_program
from xlafit.check.tpu import check_target
from xlafit.check.tpu_report import format_report, to_json
from xlafit.plan import format_plan, plan_json, plan_recipe
from xlafit.platform import hardware as tpu
from xlafit.recipes import load_config

V5E = tpu.parse_target("v5e-1")
# 8 rows of 64 tokens a core over 64 x Llama 3's vocabulary: the whole float32 logits and their
# gradient are 34 GB, twice a v5e core. The TPU compiler's time grows with the tokens a core
# (8 rows compile in a tenth of the time of 64 rows over an eighth of this vocabulary); a
# 64-wide embedding keeps the state of so many rows of it at 6.3 GB.
LOGITS_OVER = [
    *(o for o in SMALL_LLM if not o.startswith("data.per_device_batch")),
    "model.hidden_size=64",
    "model.num_heads=1",
    "model.vocab_size=8208384",
    "data.per_device_batch=8",
    "model.remat=full",
]


def _program(overrides):
    program, _, _ = recipe_program("llm", overrides)
    return dataclasses.replace(program, eval_global_batch=None)  # the train step's levers only


def test_the_levers_a_run_is_offered_follow_its_settings():
    assert [lv.overrides for lv in fit_levers_of(load_config("llm", []))] == [
        ("model.logits_chunk=1024",),
        ("model.remat=offload",),
        ("model.remat=full",),
        ("trainer.optimizer_offload=true",),  # a full fine-tune's
    ]
    lora = fit_levers_of(load_config("llm", ["lora.rank=8", "lora.base_dtype=bfloat16", "model.remat=full"]))
    assert lora[0] == FitLever("a 4-bit (NF4) frozen base", ("lora.base_dtype=nf4",), "state")
    # A quantized base only for LoRA (full fine-tuning cannot train a quantized weight), and
    # nothing a run already has.
    done = load_config("llm", ["lora.rank=8", "lora.base_dtype=nf4", "model.remat=offload", "model.logits_chunk=512"])
    assert fit_levers_of(done) == ()
    offloaded = load_config("llm", ["trainer.optimizer_offload=true", "model.remat=offload", "model.logits_chunk=512"])
    assert fit_levers_of(offloaded) == ()
    # Under tensor parallelism the residual stream split over the group, the run's own rules kept.
    tensor = fit_levers_of(load_config("llm", ["mesh.tensor=2", "mesh.rules=vocab=null", "model.remat=full"]))
    assert tensor[1] == FitLever(
        "the residual stream split over the tensor group", ("mesh.rules=vocab=null,activation_embed=tensor",)
    )
    split = load_config("llm", ["mesh.tensor=2", "mesh.rules=activation_embed=tensor"])
    assert not any("activation_embed" in " ".join(lv.overrides) for lv in fit_levers_of(split))


def test_a_tensor_parallel_run_is_told_that_splitting_its_residual_stream_fits():
    """160 scanned layers 16,384 wide at tensor 4 on a v4-8: full remat keeps each layer's
    input, 256 MiB whole on every core of the group (40 GiB in all, over a v4 core); split
    over the group (mesh.rules=activation_embed=tensor), a quarter of it, and the run fits."""
    wide = [
        "model.preset=custom", "model.num_layers=160", "model.hidden_size=16384", "model.num_heads=4",
        "model.num_kv_heads=4", "model.head_dim=16", "model.intermediate_size=64", "model.vocab_size=512",
        "model.max_position_embeddings=512", "data.seq_len=512", "model.remat=full", "model.scan_layers=true",
        "model.compute_dtype=bfloat16", "data.global_batch=16", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=4",
    ]  # fmt: skip
    program = _program(wide)
    (lever,) = [lv for lv in program.fit_levers if "activation_embed" in lv.overrides[0]]
    program = dataclasses.replace(program, fit_levers=(lever,))  # the one lever: one compile
    v4 = tpu.parse_target("v4-8")
    report = check_target(v4, program)
    assert report.train_fits is False
    fit_levers(report, v4, program)
    (split,) = report.lever_fits
    assert split.overrides == ["mesh.rules=activation_embed=tensor"] and split.fits
    inputs = 160 * 16 * 512 * 16384 * 2  # each layer's input, bfloat16
    assert report.memory["total"] - split.memory > inputs / 2, (report.memory, split.memory)
    text = format_report(report)
    assert "(the residual stream split over the tensor group): fits" in text
    # and named among the levers before any is compiled
    assert (
        "- the residual stream between layers split over the tensor group: mesh.rules=activation_embed=tensor" in text
    )


def test_a_run_whose_logits_do_not_fit_is_told_which_lever_fits_and_how_fast(capsys):
    program = _program(LOGITS_OVER)
    report = check_target(V5E, program)
    assert report.train_fits is False
    capsys.readouterr()
    fit_levers(report, V5E, program)
    by_setting = {" ".join(f.overrides): f for f in report.lever_fits}
    # One progress line a lever's compile, naming its settings (the tenth walk: two, the second
    # reading as another compile).
    said = [line for line in capsys.readouterr().err.splitlines() if "compiling" in line]
    assert said == [f"v5e-1: compiling the train step with {s}, 8 per core, 1 step(s) per call ..." for s in by_setting]
    # No quantized base (no LoRA); the optimizer state in host memory (a full fine-tune's).
    assert list(by_setting) == ["model.logits_chunk=1024", "model.remat=offload", "trainer.optimizer_offload=true"]
    chunks, offload, optimizer = by_setting.values()
    assert chunks.fits and chunks.per_device_batch == 8 and chunks.memory < report.capacity
    assert chunks.step_s > 0 and chunks.tokens_per_s == pytest.approx(8 * 64 / chunks.step_s, rel=0.02)
    assert chunks.predicted and chunks.band_median is None  # a 1-layer LoRA step: outside the measured band
    assert offload.fits is False and offload.memory > report.capacity  # the logits, not the layer inputs
    assert optimizer.fits is False and optimizer.memory > report.capacity  # nor the optimizer state
    text = format_report(report)
    took = sum(f.compile_s for f in report.lever_fits)  # walk 25: the levers' compiles are timed too
    assert took > 0 and f"the run's batch; 3 compile(s), {took:.0f} s on this machine):" in text
    line = next(x for x in text.splitlines() if "model.logits_chunk=1024" in x and "✓" in x)
    assert "(the logits in chunks): fits" in line and "(not validated)" in line and "tokens/s" in line
    assert "✗ model.remat=offload (layer inputs in host memory): does not fit, needs" in text
    out = json.loads(json.dumps(to_json(report), default=str))
    assert [f["fits"] for f in out["lever_fits"]] == [True, False, False]


def test_under_max_batch_the_levers_are_compiled_at_the_smallest_batch_refused():
    """--max-batch asked for more than fits: the levers say which makes the next batch fit."""
    chunk = FitLever("the logits in chunks", ("model.logits_chunk=1024",))
    # The probes are given: a 512-token vocabulary and 2 rows keep both compiles small (the
    # batch is the point; the TPU compiler's time grows with the rows).
    small = [*LOGITS_OVER[:-3], "model.vocab_size=512", "data.per_device_batch=2"]
    program = dataclasses.replace(_program(small), fit_levers=(chunk,))
    report = check_target(V5E, program)
    assert report.train_fits
    # The search's probes, given: the lever is compiled at the smallest refused batch (4, not 16).
    report.probes = [Probe(2, True, 0.0), Probe(4, False, 0.0), Probe(16, False, 0.0)]
    fit_levers(report, V5E, program, max_batch=True)
    (found,) = report.lever_fits
    assert found.per_device_batch == 4 and found.fits
    assert "4 per core: the smallest batch that does not fit" in format_report(report)
    report.lever_fits, report.probes = [], [Probe(2, True, 0.0)]  # nothing refused: nothing to try
    fit_levers(report, V5E, program, max_batch=True)
    assert report.lever_fits == []


def test_a_lora_run_whose_bf16_base_is_over_the_core_is_told_a_4_bit_base_fits():
    """Ten scanned layers of 8,192 x 65,536 MLPs: a 39 GB bfloat16 base, over a v4 core (v4's
    compiler is about three times as fast as v5e's) before any activation; the state's lever
    alone is compiled (the activations' cannot help), and with an NF4 base the run fits."""
    big = [
        "model.preset=llama-3.2-1b", "model.num_layers=10", "model.hidden_size=8192", "model.intermediate_size=65536",
        "model.num_heads=64", "model.num_kv_heads=8", "model.head_dim=128", "model.scan_layers=true",
        "model.compute_dtype=bfloat16", "data.seq_len=64", "data.per_device_batch=1", "data.global_batch=null",
        "lora.rank=4", "lora.base_dtype=bfloat16",
    ]  # fmt: skip
    program = _program(big)
    v4 = tpu.parse_target("v4-2")  # one chip
    report = check_target(v4, program)
    assert report.train_fits is False and report.memory["state"] > report.capacity
    fit_levers(report, v4, program)
    (nf4,) = report.lever_fits
    assert nf4.overrides == ["lora.base_dtype=nf4"] and nf4.fits
    assert nf4.memory < report.capacity < report.memory["state"]


def test_a_plan_ranks_the_memory_levers_with_the_layouts():
    """One v5e core, one layout, refused for its logits: remat's next rung (offload) is tried
    and does not fit; the logits in chunks does, and is ranked with what else fits (gradient
    accumulation), with its command. One lever alone fits: all together is not compiled."""
    plan = plan_recipe("llm", [*LOGITS_OVER, "data.eval_global_batch=8"], "v5e-1")
    by_levers = {o.candidate.levers: o for o in plan.outcomes}
    assert by_levers["remat full"].fits is False and by_levers["remat offload"].fits is False
    chunked = by_levers["remat full, logits_chunk=1024"]
    assert chunked.fits and chunked.prediction is not None and chunked in plan.fitting()
    assert {o.candidate.memory: o.fits for o in plan.outcomes if o.candidate.memory} == {
        (("model.logits_chunk", "1024"),): True,
        (("trainer.optimizer_offload", "true"),): False,  # the logits are what is over
    }
    assert "model.logits_chunk=1024" in plan.command_line(chunked)
    text = format_plan(plan)
    n = len(plan.outcomes)
    assert f"{n} compiles of train steps, 2 of them with memory levers (each alone on the 2 refused layouts" in text
    outcomes = json.loads(json.dumps(plan_json(plan), default=str))["outcomes"]
    assert [["model.logits_chunk", "1024"]] in [x["candidate"]["memory"] for x in outcomes if x["fits"]]


def test_a_levers_program_reuses_the_data_read_for_the_run(capsys):
    """Each lever's program is the run's with the lever's settings: the data read once (the
    tenth walk: the data line was printed again before every lever's compile), read again
    only for a setting of the data."""
    from xlafit.data import chat_demo

    records, _, tokenizer = chat_demo.demo_files()
    run = [*SMALL_LLM, "model.vocab_size=2000", f"data.data_dir={records}", f"data.tokenizer={tokenizer}"]
    program, _, examples = recipe_program("llm", run)
    assert examples and capsys.readouterr().err.count("data: ") == 1
    lever = program.with_overrides(("model.remat=full",))
    assert capsys.readouterr().err.count("data: ") == 0
    assert (program.model.cfg.remat, lever.model.cfg.remat) == ("none", "full")  # the lever's setting taken
    program.with_overrides(("data.seq_len=32",))
    assert capsys.readouterr().err.count("data: ") == 1


def test_a_plans_candidate_programs_reuse_the_data_read_once(capsys):
    """The sixteenth walk: `plan` printed the data line once for each candidate program (three
    times for one v5e core): each read the data again, for settings (remat, scanning, memory
    levers) that leave it alone."""
    from xlafit.plan.candidates import Candidate
    from xlafit.plan.entry import recipe_planner
    from xlafit.plan.search import Settings

    tiny = ["model.preset=custom", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=1",
            "model.intermediate_size=128", "data.seq_len=32", "data.demo=arithmetic"]  # fmt: skip
    capsys.readouterr()
    planner, _, _ = recipe_planner("llm", tiny, None, Settings())
    for remat, scan in (("full", False), ("none", True)):
        program = planner.maker(Candidate("v4-8", (8, 1, 1), 4, remat=remat, scan=scan), None)
        assert program.model.cfg.remat == remat and program.model.cfg.scan_layers is scan
    said = capsys.readouterr()
    assert sum(line.startswith("data: ") for line in said.err.splitlines()) == 1, said.err


def test_chunks_of_the_logits_are_offered_only_where_auto_keeps_them_whole():
    """A run at model.logits_chunk=auto whose logits auto chunks already was offered (and
    compiled) model.logits_chunk=1024 as a lever: the same program, a compile for nothing. It is
    a lever where auto keeps them whole (within 1/8 of the core's memory)."""
    from xlafit.check.levers import levers
    from xlafit.check.program import TargetReport
    from xlafit.platform.hardware import parse_target

    target = parse_target("v5e-1")  # 16 GiB: logits within 2 GiB stay whole
    report = TargetReport("v5e-1", per_device_batch=2, steps_per_call=1, capacity=15.75 * 2**30, memory={"state": 0})
    for seq_len, offered in ((8192, False), (128, True)):  # [2, 8192, 128256] float32 and gradient: 16.8 GB
        program, _, _ = recipe_program("llm", ["model.preset=llama-3.1-8b", f"data.seq_len={seq_len}"])
        listed = any("model.logits_chunk=1024" in text for text in levers(report, target, program))
        compiled = [lv for lv in program.fit_levers if lv.overrides == ("model.logits_chunk=1024",)]
        assert listed == offered and compiled[0].helps(2, target.hbm_bytes) == offered, seq_len
    program, _, _ = recipe_program("llm", ["model.preset=llama-3.1-8b", "data.seq_len=8192", "model.logits_chunk=0"])
    assert any("model.logits_chunk=1024" in text for text in levers(report, target, program))  # 0: always whole
