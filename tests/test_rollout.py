"""GRPO's rollout (xlafit.train.rollout) on a mesh: the generation batch's rows are split over
the data-parallel devices (each device generates its own rows, not the whole batch), and 8
simulated devices make the rollout that one device makes with the same seed."""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from tokenizers import Tokenizer

from xlafit.data import chat_demo
from xlafit.data.prompts import PromptSet
from xlafit.models import generation
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.models.lora import apply_lora
from xlafit.parallel.mesh import Strategy, make_mesh
from xlafit.parallel.sharding import tree_shardings
from xlafit.train import grpo, rollout

G, PROMPTS = 4, 4  # 16 rows: 2 per device of 8


def exact(prompts, completions, answer, **kwargs):
    return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answer, strict=True)]


def length(prompts, completions, completion_ids, **kwargs):
    return [len(ids) / 8 for ids in completion_ids]


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.from_file(str(Path(chat_demo.demo_files()[2]) / "tokenizer.json"))
    texts = [f"What is {a} plus {b}? " for a, b in [(1, 2), (3, 4), (5, 1), (2, 7)]]
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    answers = [3, 7, 6, 9]
    stop = tok.token_to_id("<|im_end|>")
    return PromptSet(texts, ids, {"answer": answers}, tok, (stop,), group=G, vocab_size=tok.get_vocab_size())


def tiny_model(vocab: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=vocab,
        max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    return apply_lora(model, ("q_proj", "v_proj"), rank=4, alpha=8, rngs=nnx.Rngs(1))


def placed(model, strategy: Strategy):
    """The model with its state on ``strategy``'s mesh, as the trainer lays it out."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, tree_shardings(state, strategy.mesh, {})))


def make_rollout(prompts, **settings):
    objective = grpo.GrpoObjective("dapo", num_generations=G, max_completion_length=6, **settings)
    return rollout.Rollout(prompts, objective, [("exact", exact), ("length", length)], iterations=2, seed=3)


def spy_on(monkeypatch, module, name):
    """Records the input shardings of each program ``module.name`` compiles, then runs it."""
    real, seen = getattr(module, name), []

    def spy(*args, **kwargs):
        seen.append(real.lower(*args, **kwargs).compile().input_shardings[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


@pytest.mark.parametrize("mesh", [{"data": 8}, {"data": 2, "fsdp": 4}])
def test_the_rollouts_rows_are_split_over_the_batch_axes(prompts, monkeypatch, mesh):
    """On 8 devices (data parallel, or FSDP) each device generates, and scores the
    log-probabilities of, its own 2 rows of the 16: the generation's token ids and the
    log-probability program's rows come in split over the mesh's batch axes."""
    strategy = Strategy(make_mesh(jax.devices(), **mesh))
    model = placed(tiny_model(prompts.vocab_size), strategy)
    generated = spy_on(monkeypatch, generation, "_run")
    scored = spy_on(monkeypatch, rollout, "_logps")
    rows = make_rollout(prompts).generation_batch(model, 0, np.repeat(np.arange(PROMPTS), G))
    assert rows["input_ids"].shape[0] == G * PROMPTS
    ((_, ids, pads, *_),) = generated  # the dynamic arguments: state, ids, pads, stop ids, seed, pad id
    assert ids.shard_shape((G * PROMPTS, prompts.prompt_length))[0] == 2 and pads.shard_shape((G * PROMPTS,)) == (2,)
    ((_, batch),) = scored  # state, rows
    assert batch["input_ids"].shard_shape(rows["input_ids"].shape)[0] == 2


def test_a_rollout_on_8_devices_is_the_rollout_on_one(prompts, strategy1):
    """The same seed, the same weights: the completions, their rewards, advantages and
    log-probabilities of two generation batches on 8 data-parallel devices are those of one
    device (the sampler's random bits do not depend on how the rows are split)."""
    model = tiny_model(prompts.vocab_size)
    make = make_rollout(prompts, temperature=1.0)
    index = np.repeat(np.arange(PROMPTS), G)
    eight = placed(model, Strategy(make_mesh(jax.devices(), data=8)))
    one = placed(model, strategy1)
    for step in (0, 2):
        a = make.generation_batch(eight, step, index)
        b = make.generation_batch(one, step, index)
        timing = "log/rollout_tokens_per_sec"
        assert sorted(a) == sorted(b)
        for key in a:
            if key == timing:
                continue
            if key == "old_logps":
                np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-5, err_msg=key)
            else:
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        assert a["loss_mask"].sum() > 0
    assert len({tuple(r) for r in a["input_ids"]}) > PROMPTS  # it sampled: the group's rows differ


def test_the_rollouts_example_is_the_row_it_makes(prompts):
    """``xlafit check --tpu`` compiles the train step for :meth:`Rollout.example`: the keys,
    shapes and dtypes of the rows a generation batch really makes."""
    make = make_rollout(prompts, beta=0.04)
    rows = make.generation_batch(tiny_model(prompts.vocab_size), 0, np.repeat(np.arange(PROMPTS), G))
    example = make.example()
    assert sorted(example) == sorted(rows)
    for key, x in rows.items():
        assert (x.shape[1:], x.dtype) == (example[key].shape, example[key].dtype), key


def test_the_generation_pads_the_rows_to_a_multiple_of_the_devices():
    """Three prompts on 8 data-parallel devices: the rows are filled up to 8 and cut back to
    the three answers, the answers one device gives."""
    cfg = LlamaConfig(
        num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=97,
        max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    asked = [[5, 6, 7, 8], [11, 12], [40, 41, 42]]
    sampling = generation.Sampling(temperature=1.0, seed=7)
    expected = generation.generate(model, asked, 5, sampling)
    strategy = Strategy(Mesh(np.array(jax.devices()).reshape(8), ("data",)))
    assert generation.generate(placed(model, strategy), asked, 5, sampling) == expected
