"""``xlafit plan``: candidates, the collectives of compiled TPU programs, cost arithmetic, the
search on real TPU compiles, and the written plan read back by ``train`` and ``check``."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
import yaml
from flax import nnx

from xlafit.check import check_file, check_recipe
from xlafit.check.program import Program
from xlafit.check.tpu import Steps, no_persistent_cache
from xlafit.cli import build_parser, main
from xlafit.cli.entry import _parse
from xlafit.config import TrainerConfig
from xlafit.errors import ConfigError
from xlafit.overrides import parse_overrides
from xlafit.parallel.sharding import logical
from xlafit.plan import format_plan, plan_file, plan_json, plan_recipe, recipe_planner
from xlafit.plan.candidates import Candidate, mesh_refusal, meshes, params_of
from xlafit.plan.cost import program_cost, reachable_gain
from xlafit.plan.outcome import Outcome, Prediction
from xlafit.plan.result import Plan
from xlafit.plan.search import Planner, Settings
from xlafit.platform.hardware import PRICES, parse_target
from xlafit.predict.collectives import collectives, loop_trips, summarize
from xlafit.recipes import load_config

pytest.importorskip("libtpu")  # the TPU compiler (the dev extra installs it)

CASES = Path(__file__).parent / "check_cases"


class MLP(nnx.Module):
    """Two named matrices (embed x mlp), no biases: its parameter bytes are known."""

    def __init__(self, rngs: nnx.Rngs, width: int = 1024, hidden: int = 4096) -> None:
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(width, hidden, use_bias=False, kernel_init=logical(init, "embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(hidden, width, use_bias=False, kernel_init=logical(init, "mlp", "embed"), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.relu(self.up(x)))


def mse(model: MLP, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["x"]) ** 2, axis=-1)


def mlp_program(mesh: tuple[int, int, int], per_device: int = 16) -> Program:
    model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    example = {"x": jax.ShapeDtypeStruct((1024,), jnp.float32)}
    return Program(model, mse, optax.sgd(0.1), TrainerConfig(), example, per_device_batch=per_device, mesh=mesh)


# ----------------------------------------------------------------------------- candidates


def test_meshes_are_every_factorisation():
    found = meshes(8)
    assert len(found) == len(set(found)) == 10
    assert all(math.prod(m) == 8 for m in found)
    assert found[0] == (8, 1, 1)  # data parallelism first
    assert meshes(1) == [(1, 1, 1)]


def test_mesh_refusal_follows_the_model_axes():
    params = params_of(nnx.eval_shape(lambda: MLP(nnx.Rngs(0), width=1024, hidden=4096 + 8)))
    assert mesh_refusal(params, (8, 1, 1)) is None
    assert mesh_refusal(params, (1, 8, 1)) is None
    assert mesh_refusal(params, (4, 1, 2)) is None  # mlp 4104 = 2 x 2052
    assert "does not divide" in mesh_refusal(params, (1, 1, 16))  # 4104 is no multiple of 16
    plain = params_of(nnx.eval_shape(lambda: nnx.Linear(64, 64, rngs=nnx.Rngs(0))))  # no names
    assert "no parameter" in mesh_refusal(plain, (4, 1, 2))
    assert "logical(init" in mesh_refusal(plain, (4, 1, 2))  # and how to give it one
    assert mesh_refusal(plain, (1, 8, 1)) is None  # FSDP splits a nameless parameter on its own


def test_candidate_overrides_and_layout():
    c = Candidate("v5e-8", (2, 2, 2), 16, accumulate=2, remat="full")
    assert c.shards == 4 and c.global_batch == 64
    assert c.layout == "DP 2 x FSDP 2 x TP 2" and c.levers == "remat full, accumulate 2"
    assert c.overrides() == {
        "mesh.data": 2,
        "mesh.fsdp": 2,
        "mesh.tensor": 2,
        "data.per_device_batch": 16,
        "trainer.accumulate_steps": 2,
        "model.remat": "full",
    }


# ----------------------------------------------------------------------------- collectives

HLO = """
HloModule m

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%all-reduce-scatter.1 (p: f32[1024,64]) -> f32[128,64] {
  %p = f32[1024,64]{1,0} parameter(0)
  %ar = f32[1024,64]{1,0} all-reduce(%p), channel_id=3, replica_groups=[1,8]<=[8], to_apply=%sum
  ROOT %ds = f32[128,64]{1,0} dynamic-slice(%ar), dynamic_slice_sizes={128,64}
}

%body (t: (s32[], bf16[16,64])) -> (s32[], bf16[16,64]) {
  %t = (s32[], bf16[16,64]) parameter(0)
  %x = bf16[16,64]{1,0} get-tuple-element(%t), index=1
  %g = bf16[128,64]{1,0:T(8,128)(2,1)} all-gather(%x), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] \
{'axis_1'}, dimensions={0}
  %g2 = bf16[128,64]{1,0} all-gather(%x), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, \
dimensions={0}
  ROOT %r = (s32[], bf16[16,64]) tuple(%i, %x)
}

%cond (t: (s32[], bf16[16,64])) -> pred[] {
  %t = (s32[], bf16[16,64]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (p: f32[1024,64], x: bf16[16,64]) -> f32[128,64] {
  %p = f32[1024,64]{1,0} parameter(0)
  %w = (s32[], bf16[16,64]) while(%init), condition=%cond, body=%body
  %s = f32[] all-reduce(%z), channel_id=9, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  ROOT %f = f32[128,64]{1,0} fusion(%p), kind=kCustom, calls=%all-reduce-scatter.1
}
"""


def test_collectives_read_from_hlo_text():
    found = {c.name: c for c in collectives(HLO, 8)}
    # One all-gather (two copies share channel 1) of 128 x 64 bf16 over groups of 4, run
    # once per trip of a 4-trip loop.
    assert set(found) == {"g", "s", "ar"}
    assert (found["g"].kind, found["g"].bytes, found["g"].group, found["g"].count) == ("all-gather", 16384, 4, 4)
    # The all-reduce of an all-reduce-scatter fusion is the reduce-scatter it implements.
    assert (found["ar"].kind, found["ar"].bytes, found["ar"].group) == ("reduce-scatter", 1024 * 64 * 4, 8)
    assert (found["s"].kind, found["s"].bytes, found["s"].group) == ("all-reduce", 4, 8)
    assert loop_trips(HLO) == [4]


def test_collective_seconds_over_ici():
    v5e = parse_target("v5e-8")  # 2x4, no wraparound: 400 GB/s per chip over 4 ports, halved
    found = {c.name: c for c in collectives(HLO, 8)}
    assert v5e.ici_bandwidth(4) == pytest.approx(100e9) and v5e.ici_bandwidth(8) == pytest.approx(200e9)
    assert found["g"].seconds(v5e) == pytest.approx(4 * 3 / 4 * 16384 / 100e9)
    assert found["ar"].seconds(v5e) == pytest.approx(7 / 8 * 1024 * 64 * 4 / 200e9)
    assert found["s"].seconds(v5e) == pytest.approx(2 * 7 / 8 * 4 / 200e9)  # all-reduce: two passes
    assert found["g"].seconds(parse_target("v3-8")) is None  # no ICI figure: not priced
    report = summarize(collectives(HLO, 8), v5e, per=2)
    assert report.by_kind["all-gather"]["bytes"] == 16384 * 4 / 2


def test_fsdp_collectives_of_a_compiled_program_move_the_parameters():
    """FSDP over 8 v5e cores: the forward all-gathers every weight once (the bf16 copy that
    TPU matmuls at default precision read) and the gradients reduce-scatter in float32."""
    target = parse_target("v5e-8")
    with no_persistent_cache():  # a compile-only client cannot read a cache entry back
        compiled, _ = Steps(target, mlp_program((1, 8, 1))).compile_train(16)
        dp, _ = Steps(target, mlp_program((8, 1, 1))).compile_train(16)
    report = summarize(collectives(compiled.as_text(), 8), target)
    params = 2 * 1024 * 4096
    assert report.by_kind["all-gather"]["bytes"] == params * 2
    assert report.by_kind["reduce-scatter"]["bytes"] == params * 4
    plain = summarize(collectives(dp.as_text(), 8), target)
    assert "all-gather" not in plain.by_kind  # data parallelism: parameters stay whole
    assert sum(row["bytes"] for row in plain.by_kind.values()) >= params * 4  # the gradients' all-reduce


# ----------------------------------------------------------------------------- cost arithmetic


def _outcome(target: str, examples_per_s: float, free: float = 2**30) -> Outcome:
    c = Candidate(target, (8, 1, 1), 32)
    prediction = Prediction(0.01, 0.02, 0.001, 0.02, 0.021, examples_per_s, None, 0.5)
    return Outcome(c, True, capacity=16 * 2**30, memory={"total": int(16 * 2**30 - free)}, prediction=prediction)


def test_run_time_and_cost():
    targets = [parse_target("v5e-8"), parse_target("v6e-8")]
    fast, slow = _outcome("v6e-8", 2000.0), _outcome("v5e-8", 1000.0)
    plan = Plan("bert", "xlafit plan bert", targets, [slow, fast], [], 3.6e6, [], {})
    assert plan.run_hours(slow) == pytest.approx(1.0) and plan.run_hours(fast) == pytest.approx(0.5)
    assert plan.run_cost(slow) == pytest.approx(8 * PRICES["v5e"].on_demand)
    assert plan.run_cost(fast) == pytest.approx(0.5 * 8 * PRICES["v6e"].on_demand)
    assert plan.winner is fast
    assert targets[0].price_per_hour() == pytest.approx(8 * 1.20)
    assert targets[0].price_per_hour(spot=True) == pytest.approx(8 * 0.3468)
    text = format_plan(plan)
    assert "Slices by time: v6e-8 < v5e-8" in text and "Slices by cost: v5e-8 < v6e-8" in text
    assert "Price v5e: $1.2 per chip-hour on-demand (Cloud Billing Catalog SKUs" in text
    # walks 16 and 25: plan's HBM column is the compiler's peak, as check's headline and verdict count it
    assert "(HBM GiB: the compiler's peak per core, as `check --tpu` counts it, which shows the step's buffers" in text
    assert "(run: the run's steps at the predicted step, the device's time alone: compiling, input" in text
    spot = dataclasses.replace(plan, spot=True)  # v6e-8: half an hour at 8 x 0.7803; v5e-8: an hour at 8 x 0.3468
    assert spot.run_cost(fast) == pytest.approx(0.5 * 8 * 0.7803) and spot.run_cost(slow) == pytest.approx(8 * 0.3468)
    assert "Price v6e: $0.7803 per chip-hour Spot" in format_plan(spot)
    priced = dataclasses.replace(plan, prices={"v5e": PRICES["v5e"]})
    assert "Price v6e: no on-demand price in the table (give one: --price v6e=USD)" in format_plan(priced)
    short = dataclasses.replace(plan, run_examples=30.0)  # 15 ms on v6e-8: seconds and "< $0.01", not "0.0 min, $0.00"
    text = format_plan(short)
    assert "0.015 s  < $0.01" in text and "Cheapest run: v5e-8, DP 8: < $0.01 in 0.03 s" in text
    # v5e-8 is slower but cheaper: both are on the Pareto front.
    assert plan.pareto() == {fast.candidate, slow.candidate}
    dominated = dataclasses.replace(_outcome("v5e-8", 500.0, free=2**29), candidate=Candidate("v5e-8", (4, 2, 1), 8))
    plan.outcomes.append(dominated)
    assert dominated.candidate not in plan.pareto()


def test_where_every_step_is_under_a_millisecond_the_cheapest_run_follows_the_answers_rule():
    """Walk 25: the answer of a launch-bound plan is data parallelism (the fewest collectives),
    yet "Cheapest run" named a tensor-parallel layout by the same sub-ms estimates the answer sets
    aside, and the Pareto front left the answer out without a word."""
    targets = [parse_target("v5e-8"), parse_target("v6e-8")]

    def sub_ms(target: str, mesh: tuple[int, ...], examples_per_s: float) -> Outcome:
        step = 32 / examples_per_s
        prediction = Prediction(step, step, None, step, step, examples_per_s, None, 0.01, predicted=True)
        return Outcome(
            Candidate(target, mesh, 32 // mesh[0]), True, 16 * 2**30, {"total": 2**28}, prediction=prediction
        )

    dp = sub_ms("v6e-8", (8, 1, 1), 1.0e6)
    tp = sub_ms("v5e-8", (1, 1, 8), 3.0e6)  # the estimates' cheapest and fastest
    plan = Plan("mnist", "xlafit plan mnist", targets, [tp, dp], [], 3.2e4, [], {})
    assert plan.launch_bound(plan.fitting()) and plan.winner is dp
    text = format_plan(plan)
    assert "Cheapest run: v6e-8, DP 8:" in text
    assert "of estimates under 1 ms, which launch and dispatch decide: the answer is data parallelism's)" in text


def test_a_roofline_above_the_predicted_step_is_an_estimate_that_says_why():
    """The plan's roofline beside its prediction: an estimate, and when its memory term is
    above the predicted step, why (XLA's bytes accessed include on-chip buffers)."""
    o = _outcome("v5e-8", 1000.0)
    roof = dataclasses.replace(o.prediction, compute_s=0.01, memory_s=0.0574, step_s=0.0574, bound_s=0.0574)
    outcomes = [dataclasses.replace(o, prediction=roof)]
    plan = Plan("m.py", "xlafit plan m.py", [parse_target("v5e-8")], outcomes, [], None, [], None)
    plain = format_plan(plan)
    assert "  roofline estimate: 57.4 ms (compute 10 ms at peak, a strict lower bound;" in plain
    assert "above the predicted step" not in plain  # not predicted: the estimate is the step
    above = dataclasses.replace(roof, step_s=0.0239, predicted=True)
    lines = format_plan(dataclasses.replace(plan, outcomes=[dataclasses.replace(o, prediction=above)])).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  roofline estimate: 57.4 ms"))
    assert lines[at + 1].startswith("    above the predicted step: its memory term counts XLA's bytes accessed")


def test_a_winner_that_changes_the_runs_batch_says_so_and_how_to_keep_it():
    """Without --global-batch the plan takes the fastest batch: for a small model a batch
    far beyond any tuned one (a CNN planned at 15,024 per core, 120,192 per step)."""
    targets = [parse_target("v5e-8")]
    o = _outcome("v5e-8", 1000.0)  # 32 per core over DP 8: 256 per step
    per_core = Plan("m.py", "xlafit plan m.py", targets, [o], [], None, [], None, own_per_device_batch=8)
    assert per_core.own_batch(o) == 64
    line = next(x for x in format_plan(per_core).splitlines() if x.strip().startswith("batch:"))
    assert "256 examples per step, 4x the run's own 64" in line and "without --search-batch" in line
    assert plan_json(per_core)["winner"]["own_global_batch"] == 64
    globally = dataclasses.replace(per_core, own_per_device_batch=None, own_global_batch=256)
    assert "batch:" not in format_plan(globally)  # the same batch: nothing to say
    fixed = dataclasses.replace(per_core, batch_fixed=True)  # planned at --global-batch: kept
    assert "batch:" not in format_plan(fixed)


def test_the_winners_command_pastes_back_with_the_bare_target_and_each_key_once(tmp_path):
    """A notebook target's report name ("colab = v5e-1") is no --tpu argument: the command and
    the written plan's comment name the slice as --tpu takes it; a key given twice (the run's
    global batch, then the plan's null) is written once, at the value that wins."""
    targets = [parse_target("colab")]
    o = dataclasses.replace(_outcome("colab = v5e-1", 1000.0), candidate=Candidate("colab = v5e-1", (1, 1, 1), 64))
    plan = Plan(
        "tmodel.py", "xlafit plan tmodel.py", targets, [o], [], None, ["trainer.steps_per_call=2"], None, batch_key=""
    )
    line = plan.command_line(o)
    assert line.startswith("xlafit check tmodel.py --tpu colab --per-device-batch 64 ")
    args = _parse(build_parser(), shlex.split(line)[1:])  # as `xlafit` reads it
    assert args.tpu == "colab" and args.per_device_batch == 64 and "trainer.steps_per_call=2" in args.overrides
    parse_overrides(args.overrides)  # every override is key.sub=value
    assert "#   xlafit check tmodel.py --tpu colab --config " in plan.write(tmp_path / "plan.yaml").read_text()
    recipe = dataclasses.replace(
        plan,
        source="mnist",
        preset={},
        batch_key="data.per_device_batch",
        base_overrides=["data.global_batch=8", "data.global_batch=null"],
    )
    keys = shlex.split(recipe.command_line(o))[3:]
    assert [k for k in keys if k.startswith("data.global_batch=")] == ["data.global_batch=null"]
    assert len({k.partition("=")[0] for k in keys}) == len(keys)


# ----------------------------------------------------------------------------- the search


def test_a_step_of_microseconds_is_predicted_without_the_band_measured_on_longer_ones():
    """A tiny model's step is far shorter than the steps the error band comes from: the plan
    prints its prediction marked, without the band, and says why; the JSON says so too."""
    plan = plan_file(CASES / "clean.py", [], "colab")
    p = plan.winner.prediction
    assert p.predicted and p.step_s < 1e-3 and p.outside_band and p.band_median is None
    text = format_plan(plan)
    assert (
        "ms ±" not in text
        and f"{p.step_s * 1e3:.3g}? " in text
        and "(? no error band: the step is outside the programs" in text
    )
    assert ": no error band: a step under 1 ms is outside the range" in text
    assert "check it: xlafit check " in text and " --tpu colab --per-device-batch 8 " in text
    assert plan_json(plan)["winner"]["prediction"]["outside_band"] is True


def test_a_files_written_plan_carries_its_batch_to_check(tmp_path):
    """The plan's batch (64 per core at --global-batch 64, the file's own is 8 rows) is in the
    written plan, and `check FILE --config plan.yaml` compiles that batch, not the file's."""
    plan = plan_file(CASES / "clean.py", [], "colab", global_batch=64)
    assert plan.winner.candidate.per_device_batch == 64
    written = plan.write(tmp_path / "plan.yaml")
    assert plan.write(written) == written  # an earlier plan is replaced
    assert yaml.safe_load(written.read_text())["data"] == {"per_device_batch": 64}
    (r,) = check_file(CASES / "clean.py", tpu="colab", preset=written).tpu
    assert r.fits and r.per_device_batch == 64
    (flag,) = check_file(CASES / "clean.py", tpu="colab", preset=written, per_device_batch=16).tpu
    assert flag.per_device_batch == 16  # a flag given wins
    with pytest.raises(ConfigError, match="unknown override data.seq_len"):
        check_file(CASES / "clean.py", ["data.seq_len=8"], tpu="colab")


def test_plan_of_a_model_too_big_for_data_parallelism(tmp_path):
    """The 1.6B-parameter file does not fit a v5e core replicated: the plan says why, picks a
    layout that splits the state, and `check --config` with the written plan agrees."""
    plan = plan_file(CASES / "tpu_big.py", [], "v5e-8", global_batch=64, examples=80_000)
    dp = next(o for o in plan.outcomes if o.candidate.mesh == (8, 1, 1))
    assert dp.fits is False and dp.needed > dp.capacity and dp.compile_s == 0  # the state alone: no compile
    assert "train state alone" in dp.error
    winner = plan.winner
    assert winner is not None and winner.candidate.mesh[1] > 1  # FSDP
    assert all(o.prediction.examples_per_s <= winner.prediction.examples_per_s for o in plan.fitting())
    # Ranked by the step model, each prediction with its measured error; the roofline beside it.
    assert winner.prediction.predicted and "TPU v5 lite" in winner.prediction.band and winner.prediction.bound_s > 0
    assert {o.candidate.mesh for o in plan.outcomes} == {(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1)}
    assert all("tensor" in why for _, mesh, why in plan.skipped)  # no named axes: nothing to split by tensor
    text = format_plan(plan)
    assert "Why not v5e-8 DP 8" in text and "check it: xlafit check" in text and "--per-device-batch 8" in text
    assert "step (predicted):" in text and "roofline estimate:" in text and " ms ±" not in text
    # A model of the user's own: no error band is quoted for it (validated on llm models).
    assert "  v5e: not validated for this kind of program (a model of your own, " in text
    # The six meshes with a tensor axis share one reason: one line names them all.
    (not_tried,) = [line for line in text.splitlines() if "not tried" in line]
    assert "meshes 4x1x2, 2x2x2, 1x4x2, 2x1x4, 1x2x4, 1x1x8:" in not_tried
    data = plan_json(plan)
    assert data["winner"]["overrides"]["mesh.fsdp"] == winner.candidate.mesh[1]
    assert data["winner"]["prediction"]["predicted"] and data["winner"]["prediction"]["band"]
    json.dumps(data, default=str)

    written = plan.write(tmp_path / "plan.yaml")
    assert f"--tpu v5e-8 --config {written}" in written.read_text()
    report = check_file(CASES / "tpu_big.py", tpu="v5e-8", preset=written)  # the plan's batch, from data:
    assert report.tpu[0].fits is True
    assert report.tpu[0].memory["total"] == winner.memory["total"]


WIDE = """
import jax, jax.numpy as jnp
from flax import nnx

model = nnx.eval_shape(lambda: nnx.Sequential(
    nnx.Linear(1024, 16384, rngs=nnx.Rngs(0)), jax.nn.relu, nnx.Linear(16384, 1024, rngs=nnx.Rngs(1))))
batch = {"x": jax.ShapeDtypeStruct((8, 1024), jnp.float32)}

def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["x"]) ** 2, axis=-1)
"""


def test_activations_over_hbm_are_named_and_accumulation_fits(tmp_path):
    """A global batch whose activations overflow one v5e core: the plan names the largest
    buffers (with the user's line) and fits it by accumulating micro-batches."""
    path = tmp_path / "wide.py"
    path.write_text(WIDE)
    plan = plan_file(path, [], "v5e-1", global_batch=262144)
    first = next(o for o in plan.outcomes if o.stage == "layout")
    assert first.fits is False and first.needed > first.capacity
    assert first.buffers and any("wide.py:" in b.where for b in first.buffers)
    assert plan.winner is not None and plan.winner.candidate.accumulate > 1
    assert plan.winner.candidate.global_batch == 262144
    text = format_plan(plan)
    assert f"fits with accumulate {plan.winner.candidate.accumulate}" in text and "wide.py:" in text


def test_plan_of_a_recipe_is_read_back_by_train_and_check(tmp_path):
    """The run's own global batch (32 here) unless --search-batch: each layout gets the
    per-core batch that keeps it; the plan written is a preset that `train` loads with the
    winner's mesh and batch."""
    # v4's compiler is about 3x faster than v5e's; two chips have three layouts (four have six).
    # The TPU compiler's time grows with the rows a core: 32 and 64 rows, not the recipe's 128 and 256.
    plan = plan_recipe(
        "mnist", ["trainer.steps_per_call=1", "data.global_batch=32", "data.eval_global_batch=64"], "v4-4"
    )
    assert {o.candidate.global_batch for o in plan.outcomes} == {32}
    # The preset's trainer.invariant_chunks (pure data parallelism only) gives way to layouts
    # that split the model: they were error rows.
    assert [o.error for o in plan.outcomes if o.error] == []
    assert any(o.candidate.mesh[1] > 1 for o in plan.outcomes)
    assert all(o.stage == "layout" for o in plan.outcomes)  # everything fits: no levers, no batch search
    winner = plan.winner
    # The run's eval step too, the winner's only, at the preset's eval batch over its cores.
    assert winner.eval_batch == 64 and winner.eval.fits and winner.eval_fix is None
    assert [o for o in plan.outcomes if o.eval_batch is not None] == [winner]
    # MNIST's steps on a v4 are estimated under 1 ms: data parallelism first, not the fastest estimate
    assert plan.launch_bound(plan.fitting()) and winner.candidate.data_parallel
    # Walk 25: MFU is the model's FLOPs over time (MNIST has no analytic count: the fewest per
    # example XLA counted in any layout), so on one slice it follows the throughput; XLA's own
    # count of a layout that splits the model repeats work on every core, and the table showed
    # the slowest layout with the highest MFU.
    devices = parse_target("v4-4").num_devices
    counted = [o for o in plan.outcomes if o.prediction and o.flops]
    per_example = [o.flops * devices / o.candidate.global_batch for o in counted]
    assert max(per_example) > 1.05 * min(per_example)  # the layouts' counts differ: the test can tell
    ratio = counted[0].prediction.mfu / counted[0].prediction.examples_per_s
    assert all(o.prediction.mfu / o.prediction.examples_per_s == pytest.approx(ratio, rel=1e-9) for o in counted)
    assert ratio == pytest.approx(min(per_example) / (devices * parse_target("v4-4").peak_flops), rel=1e-9)
    written = plan.write(tmp_path / "plan.yaml")
    cfg = load_config("mnist", preset=written)
    assert cfg.mesh.sizes == winner.candidate.mesh
    assert cfg.data.per_device_batch == winner.candidate.per_device_batch and cfg.data.global_batch is None
    assert cfg.trainer.steps_per_call == 1  # the plan's own overrides are kept
    assert plan.batch_fixed and "batch:" not in format_plan(plan)
    report = check_recipe("mnist", tpu="v4-4", preset=written)
    assert report.tpu[0].fits and report.tpu[0].per_device_batch == winner.candidate.per_device_batch


def test_a_price_is_a_generations_in_any_case_and_one_no_target_uses_is_warned(caplog):
    from xlafit.plan.entry import _prices

    prices = _prices({"V5E": 0.9, "v6e": 2.0}, [parse_target("kaggle")])
    assert (prices["v5e"].on_demand, prices["v5e"].source) == (0.9, "given on the command line (--price)")
    assert "--price v6e=2 prices no target of this plan (kaggle = v5e-8): not used" in caplog.text


def test_plan_budget_stops_new_compiles():
    plan = plan_recipe("mnist", [], "v5e-8", global_batch=64, budget_minutes=1e-9)
    assert plan.winner is None
    assert all(o.error and "budget" in o.error for o in plan.outcomes)
    assert "No candidate fits" in format_plan(plan)


def test_plan_cli_errors(capsys, tmp_path):
    notes = tmp_path / "precious.yaml"
    notes.write_text("my notes\n")
    assert main(["plan", "mnist", "--tpu", "v5e-1", "--write", str(notes)]) == 2  # before any compile
    assert "exists and is not a plan xlafit wrote, so it is kept" in capsys.readouterr().err
    assert notes.read_text() == "my notes\n"
    assert main(["plan", "mnist", "--tpu", "v5e-1", "--write", str(tmp_path)]) == 2
    assert "is a directory; give a file name" in capsys.readouterr().err
    assert main(["plan", "mnist", "--price", "v5e=cheap"]) == 2
    assert "--price v5e=cheap" in capsys.readouterr().err
    # Walk 25: a name that is no generation was taken and priced nothing, without a word.
    assert main(["plan", "mnist", "--tpu", "v5e-8", "--price", "v5x=1"]) == 2
    assert "--price v5x=1: no TPU generation of that name; give one of v2, v3, v4, v5e" in capsys.readouterr().err
    assert main(["plan", "mnist", "--tpu", "v5e-8", "--price", "v5e-8=9.6"]) == 2
    assert "prices are per chip-hour of a generation: --price v5e=USD" in capsys.readouterr().err
    assert main(["plan", "mnist", "--global-batch", "0"]) == 2
    assert "--global-batch 0" in capsys.readouterr().err
    assert main(["plan", "mnist", "--tpu", "v9-8"]) == 2
    assert "unknown TPU target" in capsys.readouterr().err
    assert main(["plan", "mnist", "--min-gain", "-1"]) == 2
    assert "--min-gain -1: give a percentage of 0 or more" in capsys.readouterr().err
    assert main(["plan", "mnist", "--search-batch", "--global-batch", "64"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_no_compile_starts_that_the_longest_so_far_says_would_overrun_the_budget():
    import time

    base = recipe_planner("mnist", [], None, Settings())[0].base
    now = time.monotonic()
    planner = Planner(lambda c, n: base, base, Settings(deadline=now + 60, budget_s=60))
    target = parse_target("v5e-8")
    assert not planner.over_budget(target)  # nothing compiled yet: the first compile starts
    slow = dataclasses.replace(_outcome("v5e-8", 1.0), compile_s=40.0)
    planner.outcomes[slow.candidate] = slow
    assert not planner.over_budget(target)  # 40 s from now ends before the minute is up
    planner.settings.deadline = now + 30
    assert planner.over_budget(target)  # 40 s from now ends 10 s (17 %) past the deadline
    assert not planner.over_budget(parse_target("v6e-8"))  # another target's compiles say nothing


# ----------------------------------------------------------------------------- scanned layers

BERT_6 = ["data.source=synthetic", "model.preset=tiny", "model.num_layers=6", "data.seq_len=64"]
BERT_6 += ["data.max_predictions=10", "trainer.steps_per_call=1"]


def test_a_scanned_candidate_costs_what_its_unscanned_twin_does():
    """XLA's cost analysis counts a scanned layer once: a scanned candidate's FLOPs and HBM
    bytes come from unscanned programs of 2 and 4 layers extrapolated to 6, and agree with
    the 6-layer unscanned program's own; its collectives are read from its own program."""
    planner, _, _ = recipe_planner("bert", BERT_6, None, Settings())
    assert (planner.scan, planner.layers) == (False, 6)
    target = parse_target("v4-8")
    flat = Candidate(target.name, (2, 2, 1), 1, remat="none", scan=False)
    scanned = dataclasses.replace(flat, scan=True)
    # The scanned program as the planner compiled it, kept from its own compile (not compiled twice).
    steps, kept = planner.steps(target, scanned), []
    compile_train = steps.compile_train
    steps.compile_train = lambda *a, **k: kept.append(compile_train(*a, **k)) or kept[-1]
    with no_persistent_cache():
        planner._map([(target, flat, "layout"), (target, scanned, "layout")])
    ((raw, _),) = kept
    a, b = planner.outcomes[flat], planner.outcomes[scanned]
    assert a.fits and b.fits and b.cost_compile_s > 0, b.error
    assert b.flops == pytest.approx(a.flops, rel=0.02)
    assert b.prediction.memory_s == pytest.approx(a.prediction.memory_s, rel=0.1)
    moved = [sum(row["bytes"] for row in o.comms.by_kind.values()) for o in (a, b)]
    assert moved[1] == pytest.approx(moved[0], rel=0.1) and "all-gather" in b.comms.by_kind  # FSDP's, per layer
    # The scanned program alone, its loops' products counted per trip (XLA counts the body
    # once: 44 %): within 5 %, its element-wise work counted once; the extrapolation is exact.
    assert program_cost(raw, scanned, 1, raw.as_text())[0] == pytest.approx(a.flops, rel=0.05)
    assert (raw.cost_analysis() or {})["flops"] < 0.6 * a.flops
    assert "scan layers" in b.candidate.levers and b.candidate.overrides()["model.scan_layers"] is True


def test_scanned_layers_are_a_lever_where_the_run_does_not_scan():
    planner, _, _ = recipe_planner("bert", BERT_6, None, Settings())
    target = parse_target("v5e-8")
    refused = Outcome(Candidate(target.name, (8, 1, 1), 64, remat="none", scan=False), False, capacity=1e9)
    levers = [c for _, c, _ in planner._lever_jobs(target, refused)]
    assert [(c.remat, c.scan) for c in levers] == [("dots_saveable", False), ("full", False), ("full", True)]
    scanning, _, _ = recipe_planner("bert", [*BERT_6, "model.scan_layers=true"], None, Settings())
    scanned = dataclasses.replace(refused, candidate=dataclasses.replace(refused.candidate, scan=True))
    assert [c.scan for _, c, _ in scanning._lever_jobs(target, scanned)] == [True, True]  # nothing to add


# ----------------------------------------------------------------------------- when a batch search stops


def test_the_reachable_gain_of_a_larger_batch():
    """Fits recorded by plans of BERT on a v5e-8."""
    # The 1.28B BERT, FSDP 8: 40 and 48 per core at 968 and 1,013 examples/s (+4.6 %), 72
    # refused: the step line says 8 % more at 71 (64 per core ran 12 % faster): search on.
    assert reachable_gain([(40, 968), (48, 1013)], 72) == pytest.approx(0.081, abs=0.002)
    assert reachable_gain([(40, 968), (48, 1013)], None) is None  # nothing refused yet: no bound
    assert reachable_gain([(40, 968), (48, 1013)], 49) == 0.0  # nothing left between
    # At 56 and 64 (1,064, 1,132), 72 refused: under 5 % more at 71: stop there.
    assert reachable_gain([(56, 1064), (64, 1132)], 72) < 0.05
    # A step that does not grow with the batch (all fixed cost): twice the batch, twice as fast.
    assert reachable_gain([(8, 100), (16, 200)], 33) == pytest.approx(32 / 16 - 1)


FLAX_ANNOTATED = """
import jax, jax.numpy as jnp
from flax import nnx

init = nnx.initializers.lecun_normal()

class MLP(nnx.Module):  # annotated as Flax's guides show: eager sharding left at its default
    def __init__(self, rngs):
        self.up = nnx.Linear(256, 1024, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(1024, 256, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))

model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
batch = {"x": jax.ShapeDtypeStruct((8, 256), jnp.float32)}

def loss_fn(model, batch):
    return jnp.mean(model(batch["x"]) ** 2, axis=-1)
"""


def test_a_file_annotated_with_flax_partitioning_is_planned_over_its_names(tmp_path):
    """Loading it asked for a mesh ("An auto mesh context or metadata is required"): the file
    now runs with eager sharding off and its names go through the sharding rules, so its
    tensor-parallel layouts are planned too."""
    path = tmp_path / "annotated.py"
    path.write_text(FLAX_ANNOTATED)
    plan = plan_file(path, tpu="v5e-4", global_batch=32)
    assert not plan.skipped  # every mesh of 4 devices splits something
    assert {o.candidate.mesh for o in plan.fitting()} >= {(1, 1, 4), (2, 1, 2), (4, 1, 1)}
    # Steps of microseconds, where launch and dispatch (not priced) decide: data parallelism,
    # the fewest collectives, comes first whatever the predicted microseconds say (the walk's
    # 1.4k-parameter MLP was told to take FSDP 8 for its "1.2G examples/s").
    assert plan.launch_bound(plan.fitting()) and plan.winner.candidate.mesh == (4, 1, 1)
    assert "First (every step is estimated under 1 ms, where launch and dispatch decide" in format_plan(plan)


def test_plan_of_a_keras_model_file():
    """A compiled Keras 3 model, as `check` takes it: its variables carry no axis names, so
    only data parallelism is tried (the others are listed with the reason), and it wins."""
    plan = plan_file(CASES / "keras_model.py", tpu="v5e-4", global_batch=16)
    assert plan.winner is not None and plan.winner.candidate.mesh == (4, 1, 1)
    assert plan.winner.prediction.examples_per_s > 0
    assert plan.skipped and all("split over" in why or "data-parallel only" in why for _, _, why in plan.skipped)
    assert ": v5e-4, DP 4, -, 4 per core" in format_plan(plan)


def test_ctrl_c_stops_the_plan_and_reports_what_had_compiled(tmp_path):
    """Ctrl-C during a plan: no compile starts after it, the ones in flight are abandoned, and
    the report of what had finished is printed (exit 130), not lost with a traceback."""
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import user_env

    # As from a terminal: a suite started in the background passes SIGINT down ignored, and a
    # Python started so never sees it.
    as_from_a_terminal = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    )
    cmd = [sys.executable, "-c", as_from_a_terminal, sys.executable, "-m", "xlafit", "plan", "mnist", "--tpu", "v4-8"]
    cmd += ["--write", str(tmp_path / "p.yaml"), "trainer.steps_per_call=1", "data.global_batch=32"]
    cmd += ["data.eval_global_batch=64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=user_env())
    assert proc.stderr is not None
    verdicts = 0
    for line in proc.stderr:  # a verdict, then the next compile under way: stop there
        verdicts += "per core: fits" in line or "per core: does not fit" in line
        if verdicts == 1:
            break
    proc.send_signal(signal.SIGINT)
    stopped = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert time.monotonic() - stopped < 30  # not the rest of the search's six layouts
    assert "Traceback" not in err
    lines = out.splitlines()
    assert lines[1].startswith("stopped by Ctrl-C after ") and "the search of v4-8 was cut short" in lines[1]
    rows = [line for line in lines if line.startswith(("1 ", "1* "))]
    assert rows, out  # the compile that had finished, ranked
    assert "eval step: not compiled (the plan was stopped)" in out
    assert "(the best of a search stopped before it ended)" in err and (tmp_path / "p.yaml").exists()
