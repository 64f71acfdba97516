"""``xlafit plan`` and ``check --tpu`` with a mixture of experts' ``expert`` mesh axis: the plan
compiles expert-parallel layouts beside FSDP's and ranks them; a dense model gets none."""

from __future__ import annotations

import dataclasses

import optax
import pytest
from flax import nnx

from xlafit.check.levers import levers
from xlafit.check.program import Program, TargetReport
from xlafit.check.recipes import assumed_settings
from xlafit.config import TrainerConfig
from xlafit.plan import format_plan, plan_file, plan_json, recipe_planner
from xlafit.plan.candidates import Candidate, expert_meshes, experts_of, mesh_refusal, params_of
from xlafit.plan.search import Settings
from xlafit.platform.hardware import parse_target
from xlafit.recipes import load_config

pytest.importorskip("libtpu")  # the TPU compiler (the dev extra installs it)

# Eight experts of 8,192 x 24,576 (1.6B parameters: with AdamW's moments 19 GiB per copy, more
# than a v5e core's 15.75 GiB), each token weighted over all of them by a router: the experts
# named ``experts`` (split over ``expert``) and ``embed`` (over ``fsdp``), nothing over ``tensor``.
MOE = """
import jax, jax.numpy as jnp
from flax import nnx
from xlafit.parallel.sharding import logical

class Experts(nnx.Module):
    def __init__(self, rngs, experts=8, width=8192, hidden=24576):
        init = nnx.initializers.lecun_normal()
        self.router = nnx.Param(logical(init, "embed", None)(rngs.params(), (width, experts)))
        self.w = nnx.Param(logical(init, "experts", "embed", None)(rngs.params(), (experts, width, hidden)))

    def __call__(self, x):
        gates = jax.nn.softmax(x @ self.router[...], axis=-1)
        return jnp.einsum("be,bd,edf->bf", gates, x, self.w[...])

model = nnx.eval_shape(lambda: Experts(nnx.Rngs(0)))
batch = {"x": jax.ShapeDtypeStruct((8, 8192), jnp.float32)}

def loss_fn(model, batch):
    return jnp.mean(model(batch["x"]) ** 2, axis=-1)
"""

TINY_MOE = ["model.preset=tiny-moe", "data.seq_len=64", "data.per_device_batch=1", "data.global_batch=null"]


def test_expert_layouts_divide_the_devices_and_the_experts():
    assert expert_meshes(8, 8) == [(1, 1, 1, 8), (1, 2, 1, 4), (1, 4, 1, 2)]
    assert expert_meshes(8, 6) == [(1, 4, 1, 2)]  # 6 experts do not split 4 or 8 ways
    assert expert_meshes(8, 0) == []  # a dense model
    c = Candidate("v5e-8", (1, 2, 1, 4), 2, remat="full")
    assert c.layout == "FSDP 2 x EP 4" and c.shards == 8 and c.global_batch == 16
    assert Candidate("v5e-8", (1, 1, 1, 8), 1).layout == "EP 8"
    assert Candidate("v5e-8", (1, 8, 1, 1), 1).layout == "FSDP 8"
    assert c.overrides() == {
        "mesh.data": 1,
        "mesh.fsdp": 2,
        "mesh.tensor": 1,
        "mesh.expert": 4,
        "data.per_device_batch": 2,
        "trainer.accumulate_steps": 1,
        "model.remat": "full",
    }
    assert Candidate("v5e-8", (1, 8, 1, 1), 1).overrides()["mesh.expert"] == 1  # a MoE's FSDP layout says so
    assert "mesh.expert" not in Candidate("v5e-8", (1, 8, 1), 1).overrides()  # a dense model's: as before


def test_the_llm_recipes_mixture_of_experts_gets_expert_layouts_and_a_dense_model_none():
    """The plan's layouts before any compile: tiny-moe's 8 experts add EP 8, FSDP 2 x EP 4 and
    FSDP 4 x EP 2 beside the data/FSDP/tensor meshes (which then say mesh.expert=1); the
    dense tiny model's are the meshes of three axes, as before."""
    target = parse_target("v5e-8")
    moe, _, _ = recipe_planner("llm", TINY_MOE, None, Settings())
    assert experts_of(params_of(moe.base.model)) == 8
    layouts = moe._layouts(target)
    assert [c.layout for c in layouts if c.expert > 1] == ["EP 8", "FSDP 2 x EP 4", "FSDP 4 x EP 2"]
    assert all(len(c.mesh) == 4 for c in layouts) and any(c.layout == "FSDP 8" for c in layouts)
    assert all(c.global_batch == 8 for c in layouts if c.mesh[2] == 1)  # one row per batch shard
    dense, _, _ = recipe_planner("llm", ["model.preset=tiny", *TINY_MOE[1:]], None, Settings())
    assert experts_of(params_of(dense.base.model)) == 0
    assert all(len(c.mesh) == 3 and c.expert == 1 for c in dense._layouts(target))
    # A mesh with an expert axis over a model without experts only repeats work: refused.
    why = mesh_refusal(params_of(dense.base.model), (1, 2, 1, 4))
    assert why is not None and "split over expert" in why


def test_plan_ranks_expert_and_fsdp_layouts_and_picks_one_that_fits(tmp_path):
    """Over a v5e-8, data parallelism cannot hold the experts' state (refused without a
    compile); the three FSDP layouts and the three expert-parallel ones are compiled, ranked
    together, and the plan's answer is one whose compile fits, written with its mesh.expert."""
    path = tmp_path / "moe.py"
    path.write_text(MOE)
    plan = plan_file(path, [], "v5e-8", global_batch=8)
    by_layout = {o.candidate.layout: o for o in plan.outcomes}
    assert set(by_layout) == {
        "DP 8",
        "DP 4 x FSDP 2",
        "DP 2 x FSDP 4",
        "FSDP 8",
        "EP 8",
        "FSDP 2 x EP 4",
        "FSDP 4 x EP 2",
    }
    dp = by_layout["DP 8"]
    assert dp.fits is False and dp.compile_s == 0 and "train state alone" in dp.error
    assert all(by_layout[name].fits for name in ("FSDP 8", "EP 8", "FSDP 2 x EP 4", "FSDP 4 x EP 2"))
    assert all(by_layout[name].compile_s > 0 and by_layout[name].prediction for name in ("EP 8", "FSDP 8"))
    winner = plan.winner
    assert winner is not None and winner.fits and winner.candidate in {o.candidate for o in plan.fitting()}
    assert winner.prediction.examples_per_s == max(o.prediction.examples_per_s for o in plan.fitting())
    # Expert parallelism keeps each core's experts whole: less state per core than DP's, as FSDP's.
    ep = by_layout["EP 8"]
    assert ep.hbm_used < dp.needed / 4
    text = format_plan(plan)
    assert " EP 8 " in text and " FSDP 2 x EP 4 " in text and " FSDP 8 " in text
    (not_tried,) = [line for line in text.splitlines() if "not tried" in line]  # the tensor meshes, by name
    assert "meshes DP 4 x TP 2, DP 2 x FSDP 2 x TP 2, FSDP 4 x TP 2, DP 2 x TP 4, FSDP 2 x TP 4, TP 8:" in not_tried
    data = plan_json(plan)
    assert data["winner"]["overrides"]["mesh.expert"] == winner.candidate.expert
    written = plan.write(tmp_path / "plan.yaml")
    assert f"expert: {winner.candidate.expert}" in written.read_text()


def test_check_levers_read_a_mesh_with_an_expert_axis():
    """A refused compile over ``mesh.expert`` lists its levers (it died unpacking the mesh's
    four sizes); with the experts split 4 ways and FSDP 2 there are no copies for FSDP to
    split, and ``mesh.fsdp=-1`` is the devices left, not -1."""
    target = parse_target("v5e-8")
    report = TargetReport("v5e-8", per_device_batch=1, capacity=16 * 2**30, memory={"state": 20 * 2**30})
    program = Program(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), lambda m, b: 0.0, optax.sgd(0.1), TrainerConfig(), {}, 1)
    expert = levers(report, target, dataclasses.replace(program, mesh=(1, 2, 1, 4)))
    assert not any(lever.startswith("FSDP:") for lever in expert)  # already over all 8 cores
    assert any("a larger slice" in lever for lever in expert)
    copies = levers(report, target, dataclasses.replace(program, mesh=(2, 1, 1, 4)))
    assert copies[0].startswith("FSDP: mesh.fsdp=2 ")  # two copies of the state over data, FSDP 2 beside EP 4
    fsdp_all = levers(report, target, dataclasses.replace(program, mesh=(1, -1, 1)))
    assert not any(lever.startswith("FSDP:") for lever in fsdp_all)  # mesh.fsdp=-1: all 8 already


def test_check_names_the_expert_axis_its_answer_is_for():
    """``check``'s "for:" line (the settings to copy) carries mesh.expert: it left it out."""
    overrides = [*TINY_MOE, "mesh.data=1", "mesh.fsdp=2", "mesh.expert=4"]
    cfg = load_config("llm", overrides)
    program = Program(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), lambda m, b: 0.0, optax.sgd(0.1), TrainerConfig(), {}, 1)
    assert "mesh.expert=4" in assumed_settings(cfg, program, overrides)
    assert not any(s.startswith("mesh.expert") for s in assumed_settings(load_config("llm", TINY_MOE), program, []))
