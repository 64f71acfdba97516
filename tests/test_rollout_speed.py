"""The rollout's programs priced by `xlafit check --tpu` (xlafit.check.rollout_speed), with the real
TPU compiler (libtpu) on this CPU: the generation's decode loop counted once per trip, its floor
(every step reads the policy's weights from HBM), the rollout's share of a whole GRPO step."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from flax import nnx

from xlafit.check import recipe_program
from xlafit.check.program import ProgramFit, TargetReport
from xlafit.check.tpu import Steps, no_persistent_cache, rollout_fits
from xlafit.check.tpu_report import format_report, to_json
from xlafit.parallel.cluster import start_backends
from xlafit.parallel.sharding import bytes_per_device
from xlafit.platform import hardware as tpu
from xlafit.predict.rates import Kind, rates_for

ROWS = 16  # 4 prompts x 4 completions, over the 4 cores of a v5e-4: 4 rows a core


@pytest.fixture(scope="module")
def rewards(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text("def exact(prompts, completions, answer, **kwargs):\n    return [0.0 for _ in completions]\n")
    return path


def generation(rewards, completion):
    """The rollout generation of a one-layer model for ``completion`` tokens, its weights laid
    out over the 4 cores of a v5e-4 (FSDP): its fit, the program and its steps. Its MLP of 2M
    features (768 MiB read as bfloat16, 192 MiB a core) is more than a core's on-chip memory
    holds, so that every decode step reads most of it from HBM (a tiny model's weights all stay
    on chip)."""
    settings = [
        "model.preset=custom", "model.num_layers=1", "model.hidden_size=64", "model.num_heads=4",
        "model.intermediate_size=2097152", "model.max_position_embeddings=128", "lora.rank=4", "mesh.data=1",
        "mesh.fsdp=-1", "model.objective=grpo", "data.demo=grpo", f"model.grpo.rewards={rewards}:exact",
        "model.grpo.num_generations=4", f"model.grpo.max_completion_length={completion}",
        f"data.global_batch={ROWS}",
    ]  # fmt: skip
    start_backends()
    program, _, _ = recipe_program("llm", settings)
    with no_persistent_cache():
        steps = Steps(tpu.parse_target("v5e-4"), program)
        (fit,) = rollout_fits(steps, ROWS)
    return fit, program, steps


def test_the_decode_loop_is_priced_per_step_beside_the_floor_of_reading_the_weights(rewards):
    """8 and 16 new tokens: the decode loop's 7 and 15 steps (after the prefill's first token)
    each priced, so its FLOPs and bytes grow by 15/7 (and up to the longer cache's share more);
    each step does at least the products of every weight for its core's rows; the floor is the
    policy's bytes (each core's shard) over the v5e's HBM bandwidth, once per step."""
    short, program, steps = generation(rewards, 8)
    long, _, _ = generation(rewards, 16)
    assert (short.decode_steps, long.decode_steps) == (7, 15)
    # The prompts are left-padded to the longest: the cache holds it plus the completion.
    prompt = recipe_program_prompt(program)
    trips, cache = 15 / 7, (prompt + 16) / (prompt + 8)
    for what in ("decode_flops", "decode_bytes"):
        ratio = getattr(long, what) / getattr(short, what)
        assert trips * 0.999 <= ratio <= trips * cache * 1.001, (what, ratio)
    # Every linear weight (the tied output head included, with the adapters) meets each of the
    # core's rows in each step: 2 FLOPs per weight and row at least.
    params = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(program.model, nnx.Param))}
    looked_up = [] if program.model.cfg.tie_embeddings else [k for k in params if "embed_tokens" in k]
    linear = sum(math.prod(v.shape) for k, v in params.items() if len(v.shape) == 2 and k not in looked_up)
    assert short.decode_flops >= 7 * 2 * (ROWS // 4) * linear
    # The floor: every weight's bytes, each core its FSDP shard (the compiler keeps it and
    # reduces the products, or gathers the rest first), per step; the model computes in float32,
    # but at JAX's default precision a TPU's product reads bfloat16 (the compiler converts the
    # float32 weights once, before the loop): two bytes a weight.
    placed = nnx.state(nnx.merge(steps.eval_graphdef, steps.state.params, steps.state.model_state), nnx.Param)
    shards = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(placed)}
    held = [v for k, v in shards.items() if k not in looked_up]
    weights = sum(bytes_per_device([v]) * min(2, v.dtype.itemsize) // v.dtype.itemsize for v in held)
    whole = sum(
        math.prod(v.shape) * min(2, np.dtype(v.dtype).itemsize) for k, v in params.items() if k not in looked_up
    )
    assert whole / 4 <= weights < whole / 2  # the matrices split over the 4 cores, the vectors whole
    hbm = tpu.parse_target("v5e-4").hbm_bandwidth
    assert short.weights == long.weights == weights
    # What the loop keeps in on-chip memory from step to step is not read from HBM each step.
    for fit, n in ((short, 7), (long, 15)):
        assert 0 <= fit.on_chip < weights / 2  # most of the MLP stays in HBM: the floor is most of it
        assert fit.floor_s == pytest.approx(n * max(0, weights - fit.on_chip) / hbm, rel=1e-12)
    for fit in (short, long):
        assert fit.predicted and fit.floor_s < fit.decode_s < fit.run_s
        assert 0 <= fit.decode_collective_s < fit.decode_s
        assert fit.decode_flops <= fit.flops
        assert fit.band_median is None and fit.band  # a run this short has no band, and says why
    assert jax.devices()[0].platform == "cpu"  # compiled for the TPU here, run nowhere


def recipe_program_prompt(program):
    """The longest prompt's tokens: a train row is it plus a whole completion."""
    return program.example["input_ids"].shape[0] - program.decode_loop[1] - 1


def test_the_rollouts_share_of_a_grpo_step_is_its_time_over_the_rollout_and_the_train_steps():
    """A generation batch: its rollout (every program of it), then num_iterations train steps."""
    programs = [
        ProgramFit("rollout generation", 64, True, run_s=1.5, predicted=True, band="not validated ..."),
        ProgramFit("rollout log-probabilities", 64, True, run_s=0.1, predicted=True, band="not validated ..."),
    ]
    r = TargetReport("v5e-8", steps_per_call=2, step_s=0.2, predicted=True, train_fits=True, rollout=programs)
    r.capacity, r.memory = 15.75 * 2**30, {"state": 2**30, "total": 4 * 2**30}
    assert r.rollout_s == pytest.approx(1.6)
    assert r.grpo_step_s == pytest.approx(2.0)
    assert r.rollout_share == pytest.approx(0.8)
    assert "a whole GRPO step: the rollout 1.6 s + 2 train step(s) x 200 ms = 2 s; the rollout's share 80%" in (
        format_report(r)
    )
    assert to_json(r)["rollout_share"] == pytest.approx(0.8)
    r.rollout[1].run_s = None  # a program not priced: no share claimed
    assert r.rollout_share is None and "GRPO step" not in format_report(r)


def test_a_floor_with_every_weight_in_on_chip_memory_says_so():
    """The fourteenth walk: a tiny policy's floor read "reading the policy's 0.2 MiB of weights
    ..., less the 0.4 MiB the loop keeps in on-chip memory": more kept than read."""
    fits = [
        ProgramFit("rollout generation", 64, True, run_s=1e-3, predicted=True, decode_steps=15, decode_s=5e-4,
                   floor_s=0.0, weights=200 * 2**10, on_chip=400 * 2**10),
        ProgramFit("rollout generation", 64, True, run_s=1e-3, predicted=True, decode_steps=15, decode_s=5e-4,
                   floor_s=1e-4, weights=400 * 2**10, on_chip=100 * 2**10),
    ]  # fmt: skip
    texts = []
    for fit in fits:
        r = TargetReport("v5e-8", steps_per_call=1, step_s=0.2, predicted=True, train_fits=True, rollout=[fit])
        r.capacity, r.memory = 15.75 * 2**30, {"state": 2**30, "total": 4 * 2**30}
        texts.append(next(line for line in format_report(r).splitlines() if "the loop's floor" in line))
    assert "(the loop keeps 0.4 MiB in on-chip memory: no weight read from HBM is left)" in texts[0], texts[0]
    assert "less the 0.1 MiB the loop keeps in on-chip memory" in texts[1], texts[1]


def test_a_rollout_program_is_not_validated_by_a_band_of_train_steps():
    """The v5e's band comes from train steps: a generation of a like model is not validated by it."""
    rates = rates_for("TPU v5 lite")
    like = rates.band.population[0]
    step = Kind(like.family, like.params, like.devices, like.step_s, like.training)
    assert rates.band_for(step)[1] is not None
    band, median = rates.band_for(dataclasses.replace(step, program="rollout generation"))
    assert median is None and band.startswith("not validated for this kind of program (the rollout generation, not a")


def test_the_decode_loop_exchanges_no_logits_between_the_cores(rewards, monkeypatch):
    """Under FSDP every weight is split along its width, so each decode step's logits were
    partial sums over the cores: an all-reduce of the whole [rows, vocab] logits every step
    (for Gemma 3 1B on a v5e-8, 33.6 MB a step and most of the loop's time). The loop splits the
    output layer along the vocabulary (and the MLP along its hidden units) instead, and picks
    each row's token from every core's best: no collective of the loop carries logits."""
    import re

    import xlafit.check.tpu as check_tpu
    from xlafit.train.rollout import GENERATION

    compiled_text = {}

    def keep(fit, compiled, *args):
        compiled_text[fit.name] = compiled.as_text()
        return price(fit, compiled, *args)

    price = check_tpu.price
    monkeypatch.setattr(check_tpu, "price", keep)
    vocab = 32768
    settings = [
        "model.preset=custom", "model.num_layers=1", "model.hidden_size=256", "model.num_heads=4",
        "model.intermediate_size=1024", f"model.vocab_size={vocab}", "model.max_position_embeddings=128",
        "lora.rank=4", "mesh.data=1", "mesh.fsdp=-1", "model.objective=grpo", "data.demo=grpo",
        f"model.grpo.rewards={rewards}:exact", "model.grpo.num_generations=4",
        "model.grpo.max_completion_length=8", f"data.global_batch={ROWS}",
    ]  # fmt: skip
    start_backends()
    program, _, _ = recipe_program("llm", settings)
    with no_persistent_cache():
        (fit,) = rollout_fits(Steps(tpu.parse_target("v5e-4"), program), ROWS)
    collective = r"= \w+\[([\d,]*)\][^ ]* (?:all-reduce|all-to-all|all-gather|reduce-scatter)(?:-start)?\(.*"
    text = compiled_text[GENERATION]
    in_loop = [m.group(1) for m in re.finditer(collective, text) if 'op_name="jit(_run)/while/body' in m.group(0)]
    assert in_loop, "the loop exchanges nothing: the test no longer looks at a sharded loop"
    carrying_logits = [s for s in in_loop if any(int(n) >= vocab // 4 for n in s.split(",") if n)]
    assert not carrying_logits, carrying_logits
    assert fit.decode_collective_s < fit.decode_s / 4
