"""`xlafit check --tpu` and `xlafit plan` for the llm recipe's post-training objectives, with the
real TPU compiler (libtpu) on this CPU: DPO compiles the pair step with its reference (the base
with the LoRA adapters off, no second copy), GRPO its train step on the rollout's rows and the
rollout's own programs beside it; plan compiles the answer's rollout programs too."""

import pytest

from xlafit.check import check_recipe, recipe_program
from xlafit.check.tpu import Steps, memory_of, no_persistent_cache
from xlafit.check.tpu_report import format_report, to_json
from xlafit.parallel.cluster import start_backends
from xlafit.plan import format_plan, plan_json, plan_recipe
from xlafit.platform import hardware as tpu
from xlafit.recipes import get_recipe, load_config

# One layer of a 2,048-wide model (68M parameters: a train state of 135 MiB with its frozen base in
# bfloat16) that outweighs everything else the step holds at 4 rows of 32 tokens: a second copy
# of the base for DPO's reference would add about 130 MiB to the 140 MiB of the SFT step. (The
# TPU compiler's time grows with the rows: 16 rows took twice as long to compile.)
WIDE = [
    "model.preset=custom", "model.num_layers=1", "model.hidden_size=2048", "model.num_heads=16",
    "model.intermediate_size=8192", "model.vocab_size=512", "model.max_position_embeddings=128",
    "lora.rank=16", "lora.base_dtype=bfloat16", "model.compute_dtype=bfloat16", "data.seq_len=32",
]  # fmt: skip


def train_step_memory(overrides):
    start_backends()
    program, _, _ = recipe_program("llm", overrides)
    with no_persistent_cache():
        steps = Steps(tpu.parse_target("v4-2"), program)  # one v4 chip: its compiler is faster than v5e's
        compiled, _ = steps.compile_train(program.global_batch)
    return memory_of(compiled, steps.state_bytes, 0)


def test_a_lora_dpo_step_takes_the_memory_of_the_same_sft_step():
    """2 pairs (4 rows) of DPO against SFT on 4 rows of the same length, compiled for one v4
    chip: the same state (the reference is the base with its adapters off) and within 10 % of
    the SFT step's memory (145.2 against 140.1 MiB): no second copy of the base."""
    dpo = train_step_memory([*WIDE, "model.objective=dpo", "data.demo=preference", "data.global_batch=2"])
    sft = train_step_memory([*WIDE, "data.demo=korean", "data.global_batch=4"])
    assert dpo["state"] == sft["state"] > 100 * 2**20
    assert dpo["total"] / sft["total"] < 1.10, (dpo, sft)


@pytest.fixture(scope="module")
def rewards(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text("def exact(prompts, completions, answer, **kwargs):\n    return [0.0 for _ in completions]\n")
    return path


TINY = [
    "model.preset=custom", "model.num_layers=1", "model.hidden_size=64", "model.num_heads=4",
    "model.intermediate_size=128", "model.max_position_embeddings=128", "lora.rank=4",
]  # fmt: skip


def grpo(rewards, *extra):
    return [
        *TINY, "model.objective=grpo", "data.demo=grpo", f"model.grpo.rewards={rewards}:exact",
        "model.grpo.num_generations=4", "model.grpo.max_completion_length=32", "data.global_batch=16", *extra,
    ]  # fmt: skip


def test_a_grpo_run_compiles_its_train_step_on_the_rollouts_rows_and_its_rollout(rewards):
    """The train step on rows of the longest prompt plus a whole completion, and the rollout's
    generation (its cache: 16 rows of prompt + 32 tokens) and log-probabilities (two steps per
    generation batch keep the policy's), each with its memory; no eval step (GRPO has none)."""
    settings = grpo(rewards, "model.grpo.num_iterations=2")
    program, _, _ = recipe_program("llm", settings)
    longest = get_recipe("llm").load_data(load_config("llm", settings))[0].prompt_length
    assert program.example["input_ids"].shape == (longest + 32,)
    assert {"advantages", "weights", "old_logps", "log/rewards/exact/mean"} <= set(program.example)
    (r,) = check_recipe("llm", settings, tpu="v5e-1").tpu
    assert r.error is None, r.message
    assert r.train_fits and r.eval is None and r.steps_per_call == 2
    assert [p.name for p in r.rollout] == ["rollout generation", "rollout log-probabilities"]
    assert all(p.fits and p.rows == 16 and (p.peak or p.total) for p in r.rollout)
    assert r.fits
    text = format_report(r)
    assert "✓ rollout generation (16 rows over all cores) fits" in text
    assert "✓ rollout log-probabilities (16 rows over all cores) fits" in text
    assert [p["name"] for p in to_json(r)["rollout"]] == [p.name for p in r.rollout]


def test_plan_compiles_the_answers_rollout_programs_and_says_its_steps_leave_them_out(rewards):
    """A GRPO plan on one v4 chip: the layout's train step ranked, then the answer's rollout
    programs compiled on its layout (the run fits only if they do); the report names them and
    says the predicted times are the train step's alone."""
    plan = plan_recipe("llm", grpo(rewards, "model.grpo.num_iterations=2"), tpu="v4-2")
    winner = plan.winner
    assert winner is not None and winner.rollout is not None
    assert [r.name for r in winner.rollout] == ["rollout generation", "rollout log-probabilities"]
    assert all(r.fits and r.rows == 16 for r in winner.rollout) and winner.run_fits
    text = format_plan(plan)
    assert "  rollout generation (16 rows over all cores): fits: the compiler's peak " in text
    assert "The step is the train step's alone: the rollout that makes its rows" in text
    assert "2 of rollout programs, for the answer" in text
    assert [r["name"] for r in plan_json(plan)["winner"]["rollout"]] == [r.name for r in winner.rollout]


def test_a_rollout_the_tpu_compiler_fails_on_is_a_line_not_a_traceback(rewards, monkeypatch):
    """The eighth walk: libtpu (of jax 0.12) fails to compile the rollout generation of an FSDP
    layout with one row a batch shard ("INTERNAL: Value <... async-collective-start.3> ...
    overlaps with another chunk"), and `check --tpu` ended in that traceback. The suite's
    libtpu compiles that program, so its failure is raised here in the compiler's place: the
    report says the program does not compile for this layout, names the compiler's line, and
    the run's verdict is that it does not compile."""
    import xlafit.check.tpu as check_tpu

    compile_program, rollout_fits = check_tpu._compile, check_tpu.rollout_fits
    internal = "INTERNAL: Value <4285 async-collective-start.3{0}> (575, 586) off: 491520 size: 8192 overlaps"
    compiles: list[str] = []  # the rollout's compiles so far: the first is its generation

    def failing_generation(lower, *args, **kwargs):
        if compiles:
            compiles.append("compiled")
            if len(compiles) == 2:
                raise RuntimeError(f"{internal}\nwith another chunk")
        return compile_program(lower, *args, **kwargs)

    def rollout(*args, **kwargs):
        compiles.append("rollout")
        try:
            return rollout_fits(*args, **kwargs)
        finally:
            compiles.clear()

    monkeypatch.setattr(check_tpu, "_compile", failing_generation)
    monkeypatch.setattr(check_tpu, "rollout_fits", rollout)
    (r,) = check_recipe("llm", grpo(rewards), tpu="v5e-1").tpu
    assert r.error is None and r.train_fits
    generation = next(p for p in r.rollout if p.name == "rollout generation")
    assert generation.failed and not generation.fits and generation.message == internal
    assert r.fits is False
    text = format_report(r)
    assert "✗ rollout generation (16 rows over all cores) does not compile for this layout: the TPU compiler" in text
    assert f"    the compiler: {internal}" in text
    assert "✗ the run does not compile: its rollout generation does not" in text
    assert to_json(r)["rollout"][0]["failed"] is True


def test_a_dpo_check_with_a_precomputed_reference_runs_no_reference_pass(capsys, monkeypatch):
    """The fifteenth walk: `check --tpu` of a DPO run with model.preference.reference=precomputed
    built the starting model and ran it over every pair on the CPU (for an 8B model: its whole
    weights in host memory, and hours) before compiling a step that reads their shape alone."""
    from xlafit.train import preference

    def no_pass(*args, **kwargs):
        raise AssertionError("a check ran the reference's pass")

    monkeypatch.setattr(preference, "reference_logps", no_pass)
    overrides = [*TINY[:-1], "model.objective=dpo", "model.preference.reference=precomputed", "data.demo=preference",
                 "data.global_batch=2", "data.seq_len=32"]  # fmt: skip
    start_backends()
    program, _, _ = recipe_program("llm", overrides)
    assert program.example["ref_logps"].shape == (2,)
    assert "the reference's log-probabilities: not computed for a check" in capsys.readouterr().err
