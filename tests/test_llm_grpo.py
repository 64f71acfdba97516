"""The llm recipe's GRPO (model.objective=grpo): settings refused before any data is read, a
pulse with LoRA, the KL to the base and two steps per generation batch, and a GRPO run stopped
(kill -9 in the long form) and resumed to the uninterrupted run's metrics bit for bit."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest

import xlafit
from helpers import long_form, user_env
from xlafit.check import check_recipe
from xlafit.data import chat_demo
from xlafit.errors import ConfigError, DataError
from xlafit.recipes import get_recipe
from xlafit.train.rollout import sampler_seed

XLAFIT = [sys.executable, "-m", "xlafit"]
REWARDS = """
def exact(prompts, completions, answer, **kwargs):
    return [1.0 if c[0]["content"].strip().endswith(f"is {a}.") else 0.0 for c, a in zip(completions, answer)]

def short(prompts, completions, completion_ids, **kwargs):
    return [-len(ids) / 8 for ids in completion_ids]
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """12 sums as conversational prompts with their answers, and the two rewards."""
    root = tmp_path_factory.mktemp("grpo")
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}], "answer": str(a + b)}
        for a, b in [(a, b) for a in range(4) for b in range(3)]
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(REWARDS)
    return root


def overrides(files, run_dir, *extra):
    return [
        "model.objective=grpo",
        f"model.grpo.rewards={files / 'rewards.py'}:exact,short",
        f"data.data_dir={files / 'prompts.jsonl'}",
        f"data.tokenizer={chat_demo.demo_files()[2]}",
        f"run.run_dir={run_dir}",
        *("data.global_batch=8", "model.grpo.num_generations=4", "model.grpo.max_completion_length=6"),
        *("trainer.epochs=1", "trainer.log_every_steps=1", "model.max_position_embeddings=64"),
        *extra,
    ]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["model.objective=grpo"], r"learns from rewards: name the reward functions, as model.grpo.rewards="),
        (["model.grpo.beta=0.04"], r"full fine-tuning \(lora.rank=0\) has no frozen base .* Set lora.rank=16"),
        (["trainer.steps_per_call=3", "model.grpo.num_iterations=2"], r"drop trainer.steps_per_call"),
        (["model.grpo.reward_weights=1"], r"1 weight for the 2 functions"),
        (["model.grpo.temperature=0"], r"^model.grpo.temperature=0: give a temperature above 0"),  # that key alone
        (["model.grpo.max_completion_length=0"], r"^model.grpo.max_completion_length=0: give 1 token or more \("),
        (["model.grpo.loss_type=ppo"], r"model.grpo.loss_type"),
        (["trainer.stop_at_step=3", "model.grpo.num_iterations=2"], r"stops inside a generation batch"),
    ],
)
def test_grpo_settings_that_cannot_work_are_refused(files, tmp_path, settings, message):
    args = overrides(files, tmp_path, *settings)
    if settings == ["model.objective=grpo"]:
        args = [a for a in args if not a.startswith("model.grpo.rewards")]
    with pytest.raises(ConfigError, match=message) as e:
        get_recipe("llm").validate(xlafit.load_config("llm", args))
    assert "\n" not in str(e.value)


def test_a_group_that_does_not_divide_the_batch_is_refused(files, tmp_path):
    cfg = xlafit.load_config("llm", overrides(files, tmp_path, "model.grpo.num_generations=3"))
    with pytest.raises(ConfigError, match=r"8 completions is not a whole number of groups of .*num_generations=3"):
        xlafit.train_and_evaluate(cfg)
    assert not (tmp_path / "checkpoints").exists()  # nothing trained


def test_a_prompt_with_no_room_for_a_completion_is_refused_as_it_is_read(files, tmp_path):
    """A prompt longer than the model's context (64 positions) less max_completion_length (6)
    is refused when the prompts are read, before anything compiles, in one line naming the
    record, its length, the limit and the fixes."""
    long_sum = " plus ".join(str(n) for n in range(40))
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} plus 1?"}], "answer": str(a + 1)} for a in range(4)]
    rows.insert(2, {"prompt": [{"role": "user", "content": f"What is {long_sum}?"}], "answer": "780"})
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = xlafit.load_config("llm", [*overrides(files, tmp_path / "run"), f"data.data_dir={data}"])
    with pytest.raises(DataError) as e:
        xlafit.train_and_evaluate(cfg)
    message = str(e.value)
    assert "\n" not in message
    assert re.fullmatch(
        rf"{re.escape(str(data))}, record 3: its prompt has \d+ tokens, more than the 58 a prompt may have \(the "
        r"model's context of 64 positions less model.grpo.max_completion_length=6\); shorten that prompt \(or leave "
        r"the record out\), lower model.grpo.max_completion_length, or use a model with a longer context\.",
        message,
    ), message
    assert not (tmp_path / "run").exists()  # refused before the run directory, or any compile
    # A completion as long as the context leaves room for no prompt: the setting is named, not a record.
    cfg = xlafit.load_config(
        "llm", [*overrides(files, tmp_path / "run"), f"data.data_dir={data}", "model.grpo.max_completion_length=100"]
    )
    with pytest.raises(DataError, match=r"^model.grpo.max_completion_length=100 leaves no room for a prompt in the "):
        xlafit.train_and_evaluate(cfg)


def test_check_runs_the_step_on_the_rows_the_rollout_makes(files, tmp_path):
    """`xlafit check llm` (here, no TPU) with GRPO's settings: the rollout answers whole groups
    with the model (LoRA and its reference included) and the step runs on its rows."""
    report = check_recipe("llm", overrides(files, tmp_path, "lora.rank=4", "model.grpo.beta=0.04"))
    assert report.ok, [f.message for f in report.findings]
    # The eighth walk: a note told the user to return unreduced values from loss_fn "to evaluate
    # too": the loss is the recipe's own, and GRPO has no evaluation.
    assert not report.notes, report.notes


def test_pulse(files, tmp_path):
    """LoRA, the KL to the base (adapters off) and two steps per generation batch: a run that
    learns (the second batch's policy differs from the base: KL above 0) and logs every
    statistic."""
    settings = ["lora.rank=4", "model.grpo.beta=0.04", "model.grpo.num_iterations=2", "trainer.stop_at_step=4",
                "optimizer.warmup_steps=0", "optimizer.learning_rate=0.05", "optimizer.decay=constant"]  # fmt: skip
    result = xlafit.train_and_evaluate(xlafit.load_config("llm", overrides(files, tmp_path, *settings)))
    first, second = result.history[0], result.history[1]
    assert [r["step"] for r in result.history] == [2, 4]  # a call is a generation batch of two steps
    for name in ("reward", "reward_std", "rewards/exact/mean", "rewards/exact/std", "rewards/short/mean", "kl",
                 "completions/mean_length", "clip_ratio/region_mean", "frac_reward_zero_std",
                 "rollout_tokens_per_sec"):  # fmt: skip
        assert name in first, name
    assert 1 <= first["completions/mean_length"] <= 6
    assert first["grad_norm"] > 0 or second["grad_norm"] > 0
    assert second["kl"] > 0  # the adapters moved the policy away from the base
    saved = (tmp_path / "config.yaml").read_text()
    assert "steps_per_call: 2" in saved


def test_a_policy_equal_to_its_reference_takes_no_step_on_any_mesh(files, tmp_path):
    """The ninth walk: with the KL term on (beta > 0) and rewards with no spread (every
    advantage 0), a run on 8 devices stepped on rounding: the reference's pass (adapters off, a
    program of its own) rounded apart from the train step's, the KL's gradient was ~5e-9
    instead of 0, and Adam divided it by its own size. While the adapters add nothing, the
    policy is its reference: no gradient, no step, as on one device and in TRL."""
    (tmp_path / "flat.py").write_text(
        "def flat(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    settings = [f"model.grpo.rewards={tmp_path / 'flat.py'}:flat", "lora.rank=4", "model.grpo.beta=0.1",
                "trainer.stop_at_step=2", "optimizer.warmup_steps=0", "optimizer.learning_rate=0.05",
                "mesh.data=1", "mesh.fsdp=8"]  # fmt: skip
    result = xlafit.train_and_evaluate(xlafit.load_config("llm", overrides(files, tmp_path / "run", *settings)))
    assert [(r["step"], r["frac_reward_zero_std"]) for r in result.history] == [(1, 1.0), (2, 1.0)]
    assert [(r["grad_norm"], r["kl"]) for r in result.history] == [(0.0, 0.0), (0.0, 0.0)]


def test_the_sampler_seed_is_a_function_of_seed_and_step():
    assert sampler_seed(0, 5) == sampler_seed(0, 5)
    assert len({sampler_seed(s, t) for s in range(3) for t in range(50)}) == 150


def records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    timing = ("examples_per_sec", "tokens_per_sec", "mfu", "step_time_s", "input_wait_s", "compiles", "time",
              "rollout_tokens_per_sec")  # fmt: skip
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in lines]


def by_step(run_dir):
    """The last record of each (split, step): a step logged again after a resume counts once."""
    return {(r["split"], r["step"]): r for r in records(run_dir)}


def test_a_grpo_run_stopped_and_resumed_logs_the_uninterrupted_metrics(files, tmp_path, capsys):
    """A GRPO run stopped after its second generation batch (a checkpoint at every one), then
    run again to its fourth, logs the same numbers, bit for bit, as the run that was never
    stopped (trainer.stop_at_step keeps the schedule): the sampler's seed is a function of
    (seed, step), and the old log-probabilities of a generation batch never outlive its call."""
    settings = ["lora.rank=4", "model.grpo.num_iterations=2", "trainer.checkpoint_every_steps=2"]
    # A third reward, as TRL's take it: trainer_state (the run's step, length and epoch) where
    # its generation batch was scored, written down; async, as TRL allows.
    for name in ("whole", "cut"):
        (tmp_path / f"{name}.py").write_text(
            REWARDS + "import json\n"
            "async def seen(prompts, completions, trainer_state, **kwargs):\n"
            f"    with open({str(tmp_path / (name + '.seen'))!r}, 'a') as f:\n"
            "        s = trainer_state\n"
            "        f.write(json.dumps([s.global_step, s.max_steps, s.epoch]) + '\\n')\n"
            "    return [0.0] * len(prompts)\n"
        )

    def run(run_dir, stop):
        rewards = f"model.grpo.rewards={tmp_path / run_dir.name}.py:exact,short,seen"
        args = [*overrides(files, run_dir, *settings, f"trainer.stop_at_step={stop}"), rewards]
        return xlafit.train_and_evaluate(xlafit.load_config("llm", args))

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run(whole, 8)
    run(cut, 4)
    assert max(r["step"] for r in records(cut) if r["split"] == "train") == 4
    capsys.readouterr()
    run(cut, 8)
    assert "resumed from checkpoint 4 " in capsys.readouterr().out
    assert max(r["step"] for r in records(whole) if r["split"] == "train") == 8
    assert by_step(cut) == by_step(whole)
    seen = [json.loads(line) for line in (tmp_path / "whole.seen").read_text().splitlines()]
    assert [s[0] for s in seen] == [0, 2, 4, 6]  # one generation batch per two steps (num_iterations=2)
    # 12 prompts of 4 completions in batches of 8, each trained twice: 12 steps, the whole (1-epoch) run
    assert [s[1:] for s in seen] == [[12, 0.0], [12, 2 / 12], [12, 4 / 12], [12, 6 / 12]]
    assert (tmp_path / "cut.seen").read_text() == (tmp_path / "whole.seen").read_text()


def test_a_grpo_job_of_two_processes_trains_as_one_process_and_asks_each_reward_once(files, tmp_path):
    """GRPO was refused in a job of several processes (a pod slice's hosts). Its rollout now
    generates the whole batch on the job's mesh, asks the reward functions in process 0 alone
    (each called once per completion, as in one process) and hands each process its rows:
    2 processes x 4 devices log what 1 process x 8 devices logs (the loss to float rounding,
    a gradient step included), and a reward that raises in process 0 ends both processes,
    each naming it, after both saved the steps before it. The weights are split over both
    processes (FSDP 8), where a LoRA run stopped at its start: the frozen base's fingerprint
    read the arrays as if one process held them (the twenty-sixth walk)."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        REWARDS + "def counted(prompts, completions, trainer_state, seen, **kwargs):\n"
        f"    with open({str(tmp_path / 'calls')!r} + seen[0], 'a') as f:\n"
        "        f.write(f'{len(completions)}\\n')\n"
        "    if trainer_state.global_step >= 4:\n"
        "        raise ValueError('no judge today')\n"
        "    return [0.0] * len(completions)\n"
    )
    # FSDP over both processes: the LoRA base's fingerprint, generation and the train step on sharded weights
    settings = ["lora.rank=4", "model.grpo.num_iterations=2", "model.grpo.beta=0.04", "mesh.data=1", "mesh.fsdp=8",
                "trainer.checkpoint_every_steps=100", f"model.grpo.rewards={rewards}:exact,short,counted"]  # fmt: skip
    with_seen = files / "prompts.jsonl"
    rows = [json.loads(line) | {"seen": ".one"} for line in with_seen.read_text().splitlines()]
    (tmp_path / "one.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(r | {"seen": ".two"}) + "\n" for r in rows))
    one, two = tmp_path / "one", tmp_path / "two"
    reference = overrides(files, one, *settings, "trainer.stop_at_step=4", f"data.data_dir={tmp_path / 'one.jsonl'}")
    xlafit.train_and_evaluate(xlafit.load_config("llm", reference))

    launch = [*XLAFIT, "launch", "--processes", "2", "--devices-per-process", "4", "--log-dir", str(tmp_path / "logs")]
    job = [*XLAFIT, "train", "llm", *overrides(files, two, *settings, f"data.data_dir={tmp_path / 'two.jsonl'}")]
    out = subprocess.run([*launch, "--", *job], capture_output=True, text=True, env=user_env(), timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "devices: 8 x cpu (2 process(es))" in out.stdout
    assert "reward function counted raised ValueError: no judge today" in out.stderr
    assert "The steps before it are kept: checkpoint 4 saved" in out.stderr, out.stderr[-2000:]
    assert "a reward function failed in process 0" in (tmp_path / "logs" / "process-1.log").read_text()

    # the third generation batch (steps 5 and 6) failed: steps 1-4 as in one process, saved by the job
    got, want = by_step(two), by_step(one)
    assert sorted(got) == sorted(want) == [("train", 2), ("train", 4)]
    for key, record in want.items():  # float rounding apart (the loss, the schedule's rate)
        numbers = {k for k, v in record.items() if isinstance(v, float)}
        assert {k: got[key][k] for k in numbers} == pytest.approx({k: record[k] for k in numbers}, rel=1e-6, abs=1e-9)
        assert {k: v for k, v in got[key].items() if k not in numbers} == {
            k: v for k, v in record.items() if k not in numbers
        }
    assert want[("train", 4)]["grad_norm"] > 0
    assert (two / "checkpoints" / "4").is_dir()
    assert (tmp_path / "calls.one").read_text() == "8\n8\n"  # each generation batch's 8 completions, once
    # and the third, which raised, then its first group alone (finding the prompt to name): in process 0 alone
    assert (tmp_path / "calls.two").read_text() == "8\n8\n8\n4\n"


def test_a_resume_may_change_the_rewards_weights_and_says_so(files, tmp_path, capsys):
    """The fourteenth walk: a reward weight changed between two sessions was refused ("This
    change breaks continuation from its checkpoints") and the run could only start over; a
    weight changes what the rewards say, not the checkpoints. Other GRPO settings still refuse."""
    run = lambda *extra: xlafit.train_and_evaluate(  # noqa: E731
        xlafit.load_config("llm", overrides(files, tmp_path, "lora.rank=4", *extra))
    )
    run("trainer.stop_at_step=2")
    capsys.readouterr()
    result = run("trainer.stop_at_step=4", "model.grpo.reward_weights=1,0.5")
    out = capsys.readouterr().out
    assert "resuming with changed settings: model.grpo.reward_weights null -> '1,0.5'" in out, out
    assert "resumed from checkpoint 2 " in out and result.history[-1]["step"] == 4
    with pytest.raises(ConfigError, match=r"model.grpo.temperature: 1.0 in the run, 0.5 now. This change breaks"):
        run("trainer.stop_at_step=6", "model.grpo.reward_weights=1,0.5", "model.grpo.temperature=0.5")


@long_form(
    51,
    "test_a_grpo_run_stopped_and_resumed_logs_the_uninterrupted_metrics (GRPO's exact resume) and "
    "test_preemption's kill -9 loop",
)
def test_kill_9_during_a_grpo_run_resumes_to_the_uninterrupted_metrics(files, tmp_path):
    """A GRPO run killed while training (a checkpoint at every generation batch), then run
    again, logs the same numbers, bit for bit, as the run that was never interrupted: the
    sampler's seed is a function of (seed, step), and the old log-probabilities of a
    generation batch never outlive its call."""
    settings = ["lora.rank=4", "model.grpo.num_iterations=2", "trainer.checkpoint_every_steps=2"]
    cmd = lambda run_dir: [*XLAFIT, "train", "llm", "--simulate", "1", *overrides(files, run_dir, *settings)]  # noqa: E731
    whole = tmp_path / "whole"
    out = subprocess.run(cmd(whole), capture_output=True, text=True, env=user_env())
    assert out.returncode == 0, out.stderr[-3000:]

    cut = tmp_path / "cut"
    proc = subprocess.Popen(cmd(cut), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=user_env())
    assert proc.stdout is not None
    for line in proc.stdout:  # killed just after its second generation batch is logged
        if line.startswith("[train] step 4 "):
            break
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    steps = [r["step"] for r in records(cut) if r["split"] == "train"]
    assert steps and max(steps) < max(r["step"] for r in records(whole) if r["split"] == "train")
    again = subprocess.run(cmd(cut), capture_output=True, text=True, env=user_env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from checkpoint" in again.stdout
    assert by_step(cut) == by_step(whole)


def test_settings_of_an_objective_the_run_does_not_train_are_named_as_ignored(caplog):
    """The third walk: model.grpo.num_generations=4 on a next-token run trained without a word."""
    import logging

    with caplog.at_level(logging.WARNING, logger="xlafit"):
        get_recipe("llm").validate(xlafit.load_config("llm", ["model.grpo.num_generations=4"]))
    assert [r.getMessage() for r in caplog.records] == [
        "warning: model.grpo.num_generations=4 set, but model.objective=next_token does not use model.grpo: ignored"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        dpo = ["lora.rank=4", "model.objective=dpo", "data.demo=preference", "model.preference.beta=0.5"]
        get_recipe("llm").validate(xlafit.load_config("llm", dpo))
    assert caplog.records == []  # a setting of the objective it trains


def test_data_settings_a_grpo_run_does_not_read_are_named_as_ignored(files, tmp_path, caplog):
    """The fourth walk: data.seq_len and data.eval_fraction on a GRPO run were taken without a
    word (a completion's length is model.grpo.max_completion_length; there is no held-out set);
    and the default data.seq_len (256) refused a model of 64 positions that GRPO fits."""
    import logging

    recipe = get_recipe("llm")
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        recipe.validate(xlafit.load_config("llm", overrides(files, tmp_path)))  # 64 positions, seq_len 256
    assert caplog.records == []
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        recipe.validate(
            xlafit.load_config("llm", overrides(files, tmp_path, "data.seq_len=16", "data.eval_fraction=0.3"))
        )
    assert [r.getMessage() for r in caplog.records] == [
        "warning: data.seq_len=16, data.eval_fraction=0.3 set, but model.objective=grpo does not read them (a "
        "completion's length is model.grpo.max_completion_length; the rewards measure the run, no evaluation is "
        "held out): ignored"
    ]


def test_a_reward_function_that_raises_stops_the_run_without_a_compile_summary(files, tmp_path, capsys):
    """The fifth walk: every reward function's error came after "train step compiled 0 time(s),
    eval step 0 time(s); 0.0s compiling", a summary of steps that never ran."""
    from xlafit.errors import RewardError

    (tmp_path / "bad.py").write_text("def boom(prompts, completions, **kwargs):\n    raise ValueError('no')\n")
    cfg = xlafit.load_config(
        "llm", overrides(files, tmp_path / "run", f"model.grpo.rewards={tmp_path / 'bad.py'}:boom")
    )
    with pytest.raises(RewardError, match=r"function boom raised ValueError: no on the completions of the prompt"):
        xlafit.train_and_evaluate(cfg)
    assert "compiled 0 time(s)" not in capsys.readouterr().out


def test_a_reward_error_mid_run_keeps_the_steps_before_it_and_a_rerun_goes_on_from_them(files, tmp_path):
    """The fourteenth walk: a reward that raised at step 6 ended the run without saving steps 5
    and 6's predecessors since checkpoint 4, and its message did not say where a rerun goes on.
    The steps trained before the failing batch are logged and saved; the rerun, the function
    fixed, goes on from them and logs every step once."""
    from xlafit.errors import RewardError

    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        REWARDS + "def picky(prompts, completions, trainer_state, **kwargs):\n"
        "    if trainer_state.global_step == 3:\n"
        "        raise ValueError('an edge case')\n"
        "    return [0.0] * len(prompts)\n"
    )
    run_dir = tmp_path / "run"
    args = [*overrides(files, run_dir, "lora.rank=4", "trainer.checkpoint_every_steps=2", "trainer.stop_at_step=5"),
            f"model.grpo.rewards={rewards}:exact,short,picky"]  # fmt: skip
    with pytest.raises(RewardError) as e:
        xlafit.train_and_evaluate(xlafit.load_config("llm", args))
    assert str(e.value).endswith(
        f"fix the function (or that record) and run again. The steps before it are kept: checkpoint 3 saved in "
        f"{run_dir / 'checkpoints'}; a rerun goes on from there."
    ), str(e.value)
    rewards.write_text(rewards.read_text().replace("== 3", "== -1"))
    result = xlafit.train_and_evaluate(xlafit.load_config("llm", args))
    assert result.history[-1]["step"] == 5
    assert [r["step"] for r in records(run_dir) if r["split"] == "train"] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        [{"role": "system", "content": "Answer in tags."}, {"role": "user", "content": ""}],
        [{"role": "system", "content": "Answer in tags."}],
    ],  # fmt: skip
    ids=["empty-text", "empty-user-turn", "system-only"],
)
def test_a_prompt_with_nothing_to_answer_is_refused(prompt):
    """The fourteenth walk: an empty text prompt was refused, a conversation whose user turn
    was empty (after a system prompt) trained without a word."""
    from xlafit.data.prompts import check_prompt

    with pytest.raises(DataError, match=r"^prompts.jsonl, record 3 has (an empty prompt|no message to answer)"):
        check_prompt({"prompt": prompt}, "prompts.jsonl, record 3")
    asked = [{"role": "system", "content": "Answer in tags."}, {"role": "user", "content": "1 plus 1?"}]
    assert check_prompt({"prompt": asked}, "prompts.jsonl, record 3") == "chat"
