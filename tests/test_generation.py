"""Generation (xlafit.models.generation): the key/value cache computes what recomputing the
whole prefix does, greedy tokens equal transformers' generate on the same weights, and
sampling keeps to its top-k and top-p."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import hf_greedy, recomputed
from xlafit.hf import llama as llama_hf
from xlafit.models.generation import Sampling, filter_logits, generate
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM

PROMPTS = [[5, 6, 7, 8, 9, 10, 3], [11, 12], [40, 41, 42, 43]]


def tiny(scan: bool = False, **overrides) -> LlamaForCausalLM:
    cfg = LlamaConfig(**{
        "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
        "vocab_size": 97, "max_position_embeddings": 128, "scan_layers": scan, **overrides,
    })  # fmt: skip
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("scan", [False, True])
def test_the_cache_computes_what_recomputing_the_prefix_does(scan):
    model = tiny(scan)
    got = generate(model, PROMPTS, 7)
    assert got == [recomputed(model, p, 7) for p in PROMPTS]  # a batch of lengths 7, 2, 4: padding unseen


def transformers_greedy(model, folder, new_tokens, eos_token_id=None):
    """``transformers.generate``'s greedy new tokens for :data:`PROMPTS` (left-padded with 0)
    from ``model`` saved into ``folder``: a row per prompt."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    llama_hf.save_hf(model, folder)
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    return hf_greedy(theirs, PROMPTS, new_tokens, eos_token_id=eos_token_id)


def test_greedy_tokens_equal_transformers_generate(tmp_path):
    model = tiny(rope_theta=500000.0)
    assert generate(model, PROMPTS, 8) == transformers_greedy(model, tmp_path, 8)


def test_a_repetition_penalty_gives_transformers_greedy_tokens(tmp_path):
    """The twenty-third walk: a generation_config.json's repetition_penalty (Qwen2.5's 1.05)
    was dropped, and greedy answers differed from transformers' generate on the export. Each
    prompt alone (transformers penalises a left-padded row's pad id too), on a model that
    repeats itself within 12 tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = tiny(rope_theta=500000.0)
    llama_hf.save_hf(model, tmp_path)
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    plain = [generate(model, [p], 12)[0] for p in PROMPTS]
    for penalty in (1.3, 0.7):
        ours = [generate(model, [p], 12, Sampling(repetition_penalty=penalty))[0] for p in PROMPTS]
        assert ours == [hf_greedy(theirs, [p], 12, repetition_penalty=penalty)[0] for p in PROMPTS], penalty
        assert ours != plain  # the penalty changes what this model says
    # in a batch (left-padded), each row as it would alone: its padding is no token of it
    assert generate(model, PROMPTS, 12, Sampling(repetition_penalty=1.3)) == [
        generate(model, [p], 12, Sampling(repetition_penalty=1.3))[0] for p in PROMPTS
    ]
    with pytest.raises(ValueError, match="repetition_penalty=0: give a number above 0"):
        Sampling(repetition_penalty=0)


def test_a_sequence_ends_at_its_end_token():
    model = tiny()
    full = generate(model, PROMPTS, 6)
    stop = full[0][2]
    cut = generate(model, PROMPTS, 6, eos_ids=[stop])
    assert cut[0] == full[0][: full[0].index(stop) + 1]
    for whole, part in zip(full, cut, strict=True):
        assert whole[: len(part)] == part


def test_top_k_and_top_p_keep_only_the_likeliest():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    kept = np.isfinite(np.asarray(filter_logits(logits, top_k=2, top_p=1.0)))
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True]]
    nucleus = np.isfinite(np.asarray(filter_logits(logits, top_k=0, top_p=0.75)))
    assert nucleus.tolist() == [[True, True, False, False], [False, False, True, True]]  # 0.5 + 0.3 reach 0.75
    assert np.isfinite(np.asarray(filter_logits(logits, 0, 0.1))).sum(axis=1).tolist() == [1, 1]  # the top stays
    # A top_k past the vocabulary (--top-k 100000) keeps every token, as transformers' TopKLogitsWarper does.
    np.testing.assert_array_equal(filter_logits(logits, top_k=100_000, top_p=1.0), logits)


def test_sampling_is_reproducible_and_stays_in_the_top_k():
    model = tiny()
    sampling = Sampling(temperature=1.5, top_k=3, seed=7)
    a = generate(model, PROMPTS, 5, sampling)
    assert a == generate(model, PROMPTS, 5, sampling)
    assert a != generate(model, PROMPTS, 5, Sampling(temperature=1.5, top_k=3, seed=8))
    # Each sampled token is among the 3 likeliest after its prefix: one forward of the whole
    # sequence gives the logits after every prefix (a causal model).
    forward = nnx.jit(lambda m, ids: m(ids))
    for prompt, tokens in zip(PROMPTS, a, strict=True):
        logits = np.asarray(forward(model, jnp.array([prompt + tokens]))[0])
        for i, t in enumerate(tokens):
            assert t in np.argsort(logits[len(prompt) - 1 + i])[-3:]
    with pytest.raises(ValueError, match="0 < top_p <= 1"):
        Sampling(top_p=0.0)


def test_stop_ids_end_each_row_where_transformers_generate_ends_it(tmp_path):
    """Greedy, several stop ids, rows that stop at different steps (one never): each row's
    tokens equal transformers' generate with the same ids as eos_token_id, and inside the
    compiled loop a stopped row generates nothing more (its later tokens are the pad id)."""
    from xlafit.models.generation import _run

    model = tiny(rope_theta=500000.0)
    full = generate(model, PROMPTS, 10)
    stops = [full[0][2], full[2][5]]  # row 0 stops by its 3rd token, row 2 by its 6th
    length = max(map(len, PROMPTS))
    expected = []
    for row in transformers_greedy(model, tmp_path, 10, eos_token_id=stops):
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        assert set(row[end:]) <= {0}  # transformers pads a finished row
        expected.append(row[:end])
    got = generate(model, PROMPTS, 10, eos_ids=stops)
    assert got == expected
    assert len(got[0]) <= 3 and len({len(row) for row in got}) > 1  # the rows stop apart
    # In the loop: after its stop a row holds the pad id (here 96), not the tokens it would go on with.
    graphdef, state = nnx.split(model)
    padded = jnp.asarray([[0] * (length - len(p)) + p for p in PROMPTS], jnp.int32)
    pads = jnp.asarray([length - len(p) for p in PROMPTS], jnp.int32)
    raw = _run(graphdef, state, padded, pads, jnp.asarray(stops, jnp.int32), jnp.uint32(0), 10, Sampling(), 96)
    assert np.asarray(raw)[0].tolist() == got[0] + [96] * (10 - len(got[0]))


def test_sampling_without_a_seed_draws_one_and_returns_it():
    """--temperature 0.8 without --seed gave the same tokens every call (seed 0): a fresh seed
    is drawn per call and returned; giving it back repeats the tokens. Greedy has no seed."""
    model = tiny()
    warm = Sampling(temperature=0.8)
    a, b = generate(model, PROMPTS, 6, warm), generate(model, PROMPTS, 6, warm)
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert a != b
    assert generate(model, PROMPTS, 6, Sampling(temperature=0.8, seed=a.seed)) == a
    assert generate(model, PROMPTS, 6).seed is None
    with pytest.raises(ValueError, match=r"seed=-1: give a seed from 0 to 4294967295"):
        Sampling(temperature=1.0, seed=-1)


def test_top_k_or_top_p_without_a_temperature_samples_at_1_as_transformers_does():
    """top_k / top_p without a temperature were ignored (greedy): they sample at temperature
    1.0, transformers' default when it samples; temperature 0 with them is refused."""
    model = tiny()
    assert Sampling(top_p=0.9).temperature == 1.0 and Sampling(top_k=5).temperature == 1.0
    assert Sampling().temperature == 0.0 and not Sampling().samples
    at_one = generate(model, PROMPTS, 6, Sampling(temperature=1.0, top_k=40, seed=3))
    assert generate(model, PROMPTS, 6, Sampling(top_k=40, seed=3)) == at_one
    assert at_one != generate(model, PROMPTS, 6)
    with pytest.raises(ValueError, match=r"temperature=0 is greedy, and top_k=0, top_p=0.9 choose among"):
        Sampling(temperature=0.0, top_p=0.9)


def test_a_sharded_model_generates_what_one_device_does():
    """FSDP x TP over the 8 simulated devices: the state stays where the mesh put it."""
    from xlafit.parallel.mesh import Strategy, make_mesh
    from xlafit.parallel.sharding import tree_shardings

    model = tiny()
    expected = generate(model, PROMPTS, 5)
    strategy = Strategy(make_mesh(jax.devices(), data=1, fsdp=4, tensor=2))
    graphdef, state = nnx.split(model)
    placed = jax.device_put(state, tree_shardings(state, strategy.mesh, {}))
    assert generate(nnx.merge(graphdef, placed), PROMPTS, 5) == expected


@pytest.mark.parametrize(
    "sampling",
    [Sampling(), Sampling(temperature=1.0, seed=5), Sampling(top_k=8, seed=5), Sampling(repetition_penalty=1.3)],
)
def test_an_fsdp_model_decodes_with_its_mlp_and_vocabulary_split_and_generates_what_one_device_does(sampling):
    """Under FSDP every weight is split along its width, and each decode step summed partial
    products over the devices: an all-reduce of the whole [rows, vocab] logits every step (the
    step model's 269 of 357 ms for Gemma 3 1B's rollout on a v5e-8). The loop's weights are
    laid out along the MLP's hidden units and the vocabulary instead (decode_layout); the
    tokens drawn are those of one device, greedy and sampled, and no collective of the loop
    carries a vocabulary's worth of logits."""
    import re

    from xlafit.models.generation import generation_program
    from xlafit.parallel.mesh import Strategy, make_mesh
    from xlafit.parallel.sharding import tree_shardings

    model = tiny(vocab_size=96)  # 12 tokens a device
    expected = generate(model, PROMPTS, 6, sampling)
    mesh = Strategy(make_mesh(jax.devices(), data=1, fsdp=8, tensor=1)).mesh
    graphdef, state = nnx.split(model)
    sharded = nnx.merge(graphdef, jax.device_put(state, tree_shardings(state, mesh, {})))
    assert generate(sharded, PROMPTS, 6, sampling) == expected
    hlo = generation_program(sharded, 8, 8, 6, sampling).lower().compile().as_text()
    collective = r"= \w+\[([\d,]*)\][^ ]* (?:all-reduce|all-to-all|all-gather|reduce-scatter)\(.*"
    in_loop = [m.group(1) for m in re.finditer(collective, hlo) if 'op_name="jit(_run)/while/body' in m.group(0)]
    assert in_loop, "the loop exchanges nothing: the test no longer looks at a sharded program"
    assert not [shape for shape in in_loop if "96" in shape.split(",")], in_loop  # the prefill's are once


def test_more_tokens_than_the_context_are_refused():
    """A prompt and max_new_tokens past max_position_embeddings (128 here): one line naming
    both numbers and the largest max_new_tokens, before anything compiles or runs."""
    from xlafit.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        generate(tiny(), PROMPTS, 122)  # the longest prompt has 7 tokens
    assert str(e.value) == (
        "the longest prompt's 7 tokens + max_new_tokens=122 = 129 is more than the model's context "
        "(max_position_embeddings=128); give max_new_tokens=121 or fewer."
    )
    with pytest.raises(ConfigError, match="shorten the prompt"):
        generate(tiny(), [list(range(128))], 1)


def test_a_model_directory_without_a_usable_tokenizer_is_told_where_one_comes_from(tmp_path):
    """generate on a Hugging Face directory with no (or a broken) tokenizer.json read its
    weights first, then said to give data.tokenizer, a setting generate does not have."""
    from flax import nnx

    from xlafit.errors import DataError
    from xlafit.generator import Generator
    from xlafit.hf import llama as llama_hf
    from xlafit.models.llama import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "m"
    llama_hf.save_hf(LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=64), rngs=nnx.Rngs(0)), folder)
    fix = "needs the tokenizer.json of the model its weights come from (save_pretrained with the tokenizer"
    with pytest.raises(DataError, match=r"no tokenizer at .*m/tokenizer.json; .*m " + re.escape(fix)):
        Generator.load(str(folder))
    (folder / "tokenizer.json").write_text('{"x": 1}')
    with pytest.raises(DataError, match=r"is not a Hugging Face tokenizer.json \(.*\); .*" + re.escape(fix)) as e:
        Generator.load(str(folder))
    assert "data.tokenizer" not in str(e.value)


def test_a_run_with_no_checkpoint_says_to_train_it_not_to_export_it(tmp_path):
    import yaml

    from xlafit.data import clm
    from xlafit.errors import CheckpointError
    from xlafit.generator import Generator
    from xlafit.recipes import load_config

    run = tmp_path / "run"
    (tmp_path / "text.txt").write_text("\n\n".join(f"document {i}: the quick brown fox" for i in range(20)))
    clm.train_bpe([str(tmp_path / "text.txt")], 100, run / "tokenizer")
    cfg = load_config("llm", [f"run.run_dir={run}"])
    (run / "config.yaml").write_text(yaml.safe_dump({"recipe": "llm", **cfg.to_dict()}))
    with pytest.raises(CheckpointError) as e:
        Generator.load(str(run))
    assert str(e.value) == (
        f"{run} has no intact checkpoint to generate with; train it until it saves one, or give a Hugging Face "
        "model directory."
    )


def test_a_run_without_its_tokenizer_and_flags_of_the_other_kind_of_source_are_named(tmp_path, capsys):
    """A run directory without tokenizer/ was told to "give data.tokenizer", which generate
    does not take; --step with a Hugging Face directory, and --revision with a run, were ignored."""
    import json

    import yaml

    from xlafit.cli import main
    from xlafit.recipes import load_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"recipe": "llm", **load_config("llm", []).to_dict()}))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for args, says in [
        ([str(run)], f"{run} has no tokenizer/ (a run writes it when training starts); cannot generate."),
        ([str(hf), "--step", "3"], f"--step 3 picks a run's checkpoint, and {hf} is a Hugging Face model"),
        ([str(run), "--revision", "main"], f"--revision main picks a hub model's revision, and {run} is a run"),
    ]:
        assert main(["generate", *args, "--prompt", "hi"]) == 2
        assert says in capsys.readouterr().err


def test_a_prompts_file_line_is_a_prompt_unless_it_is_a_json_string_or_a_conversation(tmp_path):
    """--prompts-file: a JSON string is its text, {"messages": [...]} a conversation, and any
    other line (42, null, true, [1, 2], plain text) the prompt as written; an object without
    messages, or with messages that are not a conversation, is one line naming the line."""
    import argparse
    import json

    from xlafit.cli.generate import _prompts
    from xlafit.errors import ConfigError

    turn = {"role": "user", "content": "hi"}
    lines = ["42", "null", "true", "[1, 2]", "plain text", json.dumps("a string"), json.dumps({"messages": [turn]})]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    args = argparse.Namespace(prompt=["given"], prompts_file=str(path))
    assert _prompts(args) == ["given", "42", "null", "true", "[1, 2]", "plain text", "a string", [turn]]
    # A prompt-only record (GRPO's data, the fourth walk: refused) asks its prompt, text or conversation.
    path.write_text(json.dumps({"prompt": "hi", "answer": "7"}) + "\n" + json.dumps({"prompt": [turn], "answer": 7}))
    assert _prompts(args) == ["given", "hi", [turn]]
    for bad, error in [
        ({"answer": "hi"}, r'prompts.jsonl:2 is a JSON object without "messages" or "prompt" \(its keys are answer\)'),
        ({"messages": ["hi"]}, r"prompts.jsonl:2: a chat record's messages must be a list of"),
    ]:
        path.write_text("hello\n" + json.dumps(bad))
        with pytest.raises(ConfigError, match=error):
            _prompts(args)
    path.write_text('hello\n{"messages": [{"role": "user", "content": "hi"}\n')  # the fifth walk: asked as text
    with pytest.raises(ConfigError, match=r"prompts.jsonl:2 starts as a JSON object but is not JSON \(Expecting"):
        _prompts(args)
    # the sixth walk: a Parquet file of such records was read as text ("convert it with iconv")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "answer": "7"}]), tmp_path / "prompts.parquet")
    assert _prompts(argparse.Namespace(prompt=[], prompts_file=str(tmp_path / "prompts.parquet"))) == ["hi"]
    path.write_text("\n \n")  # it was told to give --prompts-file, which it had given
    with pytest.raises(ConfigError, match=r"prompts.jsonl holds no prompt \(only blank lines, or none\)"):
        _prompts(argparse.Namespace(prompt=[], prompts_file=str(path)))


# --------------------------------------------------------------------------- a chat run's end of turn

# ChatML with no {% generation %} marks, as most hub models have it: a turn ends with <|im_end|>.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QUESTION = "What is 3 plus 4?"


@pytest.fixture(scope="module")
def chatml_run(tmp_path_factory):
    """A tiny chat run as a newcomer trains one: ``data.tokenizer`` a directory whose
    ``tokenizer_config.json`` ends documents with ``</s>`` and has no chat template,
    ``data.chat_template`` a ChatML file ending turns with ``<|im_end|>``; one step."""
    import json

    import xlafit
    from xlafit.data import clm
    from xlafit.recipes import load_config

    root = tmp_path_factory.mktemp("chatml")
    sums = [(a, b) for a in range(10) for b in range(10)]
    (root / "corpus.txt").write_text("\n\n".join(f"What is {a} plus {b}? {a} plus {b} is {a + b}." for a, b in sums))
    tok = clm.train_bpe([root / "corpus.txt"], 300, root / "tok")
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(root / "tok" / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
    }
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "chatml.jinja").write_text(CHATML)
    turn = lambda a, b: [  # noqa: E731
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
    ]
    records = [{"messages": turn(a, b)} for a, b in sums]
    (root / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    run = root / "run"
    overrides = [
        f"run.run_dir={run}", f"data.data_dir={root / 'chat.jsonl'}", f"data.tokenizer={root / 'tok'}",
        f"data.chat_template={root / 'chatml.jinja'}", "data.seq_len=64", "trainer.stop_at_step=1",
        "trainer.eval_every_epochs=100",
    ]  # fmt: skip
    xlafit.train_and_evaluate(load_config("llm", overrides))
    return run


def test_a_chat_run_stops_at_its_templates_end_of_turn_not_only_at_eos(chatml_run):
    """The template closes a turn with <|im_end|>, the tokenizer's eos_token is </s>: the run
    records <|im_end|> as its eos_token (the template does not render eos_token, so what it
    renders is unchanged), and the generator stops at either."""
    import json

    from xlafit.generator import Generator

    recorded = json.loads((chatml_run / "tokenizer" / "tokenizer_config.json").read_text())
    assert recorded["eos_token"] == "<|im_end|>" and recorded["bos_token"] == "<s>"
    ask = Generator.load(str(chatml_run))
    end, eos = ask.tokenizer.token_to_id("<|im_end|>"), ask.tokenizer.token_to_id("</s>")
    assert ask.eos_ids == tuple(sorted((end, eos)))
    rendered = "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n"
    assert ask.tokenizer.decode(ask.encode(QUESTION), skip_special_tokens=False) == rendered


def test_the_end_of_turn_is_found_from_the_template_where_no_file_names_it(chatml_run, tmp_path):
    """A run's tokenizer files that still name </s> (written before the end of turn was
    recorded): its template says where a turn ends."""
    import json
    import shutil

    from xlafit.data import clm

    older = shutil.copytree(chatml_run / "tokenizer", tmp_path / "tokenizer")
    config = json.loads((older / "tokenizer_config.json").read_text())
    (older / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "</s>"}))
    tok = clm.load_tokenizer(older)
    assert clm.stop_ids(older) == tuple(sorted((tok.token_to_id("<|im_end|>"), tok.token_to_id("</s>"))))


def test_the_export_stops_in_transformers_where_xlafit_generate_does(chatml_run, tmp_path):
    """config.json names the tokenizer's bos and pad ids, and it and generation_config.json
    every end token as eos_token_id: transformers' generate on the export, with the
    export's own settings, stops at <|im_end|> with the tokens xlafit's greedy answer has."""
    import json

    from safetensors.numpy import load_file, save_file

    from xlafit.data import clm
    from xlafit.export import export_hf
    from xlafit.generator import Generator

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    export_hf(chatml_run, out)
    tok = clm.load_tokenizer(out)
    bos, eos, pad, end = (tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>", "<|im_end|>"))
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (bos, sorted((eos, end)), pad)
    assert transformers.AutoConfig.from_pretrained(out).eos_token_id == sorted((eos, end))
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": bos, "eos_token_id": sorted((eos, end)), "pad_token_id": pad}

    # An untrained model rarely says <|im_end|>: swap its output row with that of the k-th token
    # of its answer (k >= 4), which it then says instead (nothing before that step changes).
    prompt = Generator.load(str(out)).encode(QUESTION)
    free = generate(Generator.load(str(out)).model, [prompt], 16)[0]
    k = next(i for i in range(4, len(free)) if free[i] not in free[:i] and not {eos, end} & set(free[: i + 1]))
    weights = load_file(out / "model.safetensors")
    head = weights["lm_head.weight"]
    head[[free[k], end]] = head[[end, free[k]]]
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})

    ask = Generator.load(str(out))
    ours = generate(ask.model, [prompt], 16, eos_ids=ask.eos_ids)[0]
    assert ours == free[:k] + [end]
    assert ask([QUESTION], max_new_tokens=16) == [tok.decode(ours)]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    rendered = hf_tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    assert list(rendered if isinstance(rendered, list) else rendered["input_ids"]) == prompt
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        answer = theirs.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)), max_new_tokens=16)
    assert answer[0, len(prompt) :].tolist() == ours


def test_an_export_keeps_the_generation_settings_of_the_checkpoint_it_started_from(chatml_run, tmp_path):
    """A run initialised from a checkpoint with a generation_config.json (model.init_from_hf)
    exports its sampling settings and end tokens, with the tokenizer's ids."""
    import json

    import xlafit
    from xlafit.export import export_hf
    from xlafit.recipes import load_config

    base = tmp_path / "base"
    export_hf(chatml_run, base)
    settings = json.loads((base / "generation_config.json").read_text())
    extra = settings["eos_token_id"] + [settings["pad_token_id"] + 1]  # a token the checkpoint also stops at
    sampling = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (base / "generation_config.json").write_text(json.dumps({**settings, **sampling, "eos_token_id": extra}))
    overrides = [
        f"run.run_dir={tmp_path / 'tuned'}", f"model.init_from_hf={base}",
        f"data.data_dir={chatml_run.parent / 'chat.jsonl'}", "data.seq_len=64", "trainer.stop_at_step=1",
        "trainer.eval_every_epochs=100",
    ]  # fmt: skip
    xlafit.train_and_evaluate(load_config("llm", overrides))
    export_hf(tmp_path / "tuned", tmp_path / "tuned-hf")
    exported = json.loads((tmp_path / "tuned-hf" / "generation_config.json").read_text())
    assert exported == {**settings, **sampling, "eos_token_id": sorted(extra)}
    # The run stops where its export (and the checkpoint it started from) stops: the third walk found
    # `xlafit generate RUN` going on past the checkpoint's other end tokens (Qwen3's <|endoftext|>).
    from xlafit.data import clm

    assert clm.stop_ids(tmp_path / "tuned" / "tokenizer") == clm.stop_ids(tmp_path / "tuned-hf") == tuple(sorted(extra))
    # and samples with its settings where the flags leave them out, as its export does (the fifth walk)
    from xlafit.generator import sampling_defaults

    assert sampling_defaults(tmp_path / "tuned" / "tokenizer") == sampling_defaults(tmp_path / "tuned-hf") == sampling
    # The twenty-third walk: the export read the base's file as it was at export time, so a base edited
    # after training changed what the export shipped, and the run answered with other settings. The
    # run's record of its base (all of its settings) is what the export ships.
    (base / "generation_config.json").write_text(json.dumps({**settings, **sampling, "temperature": 1.3}))
    export_hf(tmp_path / "tuned", tmp_path / "tuned-hf-again")
    assert json.loads((tmp_path / "tuned-hf-again" / "generation_config.json").read_text()) == exported
    # A run recorded before runs kept every setting: the run answers with its base's settings under
    # its own, as its export ships them
    from xlafit.generator import Generator

    older = {"do_sample": True, "temperature": 0.6, "eos_token_id": sorted(extra)}
    (tmp_path / "tuned" / "tokenizer" / "generation_config.json").write_text(json.dumps(older))
    assert Generator.load(str(tmp_path / "tuned")).sampling_defaults == sampling  # top_p 0.9 the base's


def test_a_prompt_completion_run_is_asked_as_it_trained_not_in_the_chat_template(chatml_run, tmp_path, capsys):
    """A tokenizer with a chat template (an instruct model's) and prompt/completion records:
    the run trained on `<s>prompt completion</s>`, so generate gives it the text as it is by
    default, says so in a line, and --chat gives it the template."""
    import json
    import shutil

    import xlafit
    from xlafit.cli import main
    from xlafit.generator import Generator
    from xlafit.recipes import load_config

    tok_dir = shutil.copytree(chatml_run.parent / "tok", tmp_path / "tok")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    records = [{"prompt": f"What is {a} plus {b}?", "completion": f" {a + b}."} for a in range(10) for b in range(10)]
    (tmp_path / "sums.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    run = tmp_path / "run"
    overrides = [
        f"run.run_dir={run}", f"data.data_dir={tmp_path / 'sums.jsonl'}", f"data.tokenizer={tok_dir}",
        "data.seq_len=32", "data.global_batch=8", "trainer.stop_at_step=1", "trainer.eval_every_epochs=100",
    ]  # fmt: skip
    xlafit.train_and_evaluate(load_config("llm", overrides))
    assert json.loads((run / "data_format.json").read_text()) == {"format": "prompt_completion"}

    ask = Generator.load(str(run))
    bos = ask.tokenizer.token_to_id("<s>")
    assert ask.encode(QUESTION) == [bos, *ask.tokenizer.encode(QUESTION, add_special_tokens=False).ids]
    assert ask.template is not None and ask.trained_on == "prompt_completion" and not ask.chat_by_default
    rendered = "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n"
    assert ask.tokenizer.decode(ask.encode(QUESTION, use_chat=True), skip_special_tokens=False) == rendered

    capsys.readouterr()
    asked = ["generate", str(run), "--prompt", QUESTION, "--max-new-tokens", "4", "--json"]
    assert main(asked) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["answer"] == ask([QUESTION], max_new_tokens=4, use_chat=False)[0]
    assert f"{run} trained on prompt/completion records: its prompts are given as text, as it trained" in err
    assert main([*asked, "--chat"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["answer"] == ask([QUESTION], max_new_tokens=4, use_chat=True)[0]
    assert "trained on" not in err

    # its export is asked the same way (it was asked through the tokenizer's template)
    from xlafit.export import export_hf

    export_hf(run, tmp_path / "run-hf")
    exported = Generator.load(str(tmp_path / "run-hf"))
    assert exported.trained_on == "prompt_completion" and not exported.chat_by_default
    assert exported.encode(QUESTION) == ask.encode(QUESTION)


# --------------------------------------------------------------------------- the command's sampling and stops


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random model with the chat demo's tokenizer, as a Hugging Face directory."""
    import shutil

    from xlafit.data.chat_demo import demo_files
    from xlafit.data.clm import load_tokenizer
    from xlafit.models.llama import LlamaConfig

    folder = tmp_path_factory.mktemp("chat-model")
    _, _, tokenizer = demo_files()
    vocab = load_tokenizer(tokenizer).get_vocab_size()
    llama_hf.save_hf(LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=vocab), rngs=nnx.Rngs(0)), folder)
    shutil.copytree(tokenizer, folder, dirs_exist_ok=True)
    return folder


def test_the_command_says_its_drawn_seed_and_stops_at_texts_and_ids(chat_model, capsys):
    """`xlafit generate --temperature 0.8` without --seed drew no seed (the same answer every
    call): it prints the one it draws, and --seed repeats it; --top-p alone samples; --stop
    cuts the answer before a text, --stop-id ends it at a token."""
    import json

    from xlafit.cli import main
    from xlafit.generator import Generator

    asked = ["generate", str(chat_model), "--prompt", QUESTION, "--max-new-tokens", "12", "--json", "--no-chat"]

    def answer(*flags: str) -> tuple[str, str]:
        assert main([*asked, *flags]) == 0
        out, err = capsys.readouterr()
        return json.loads(out)["answer"], err

    first, err = answer("--temperature", "0.8")
    seed = int(re.search(r"^seed (\d+) \(pass --seed \1 to repeat\)$", err, re.M).group(1))
    assert answer("--temperature", "0.8", "--seed", str(seed)) == (
        first,
        err.replace(f"seed {seed} (pass --seed {seed} to repeat)\n", ""),
    )
    assert re.search(r"^seed \d+ ", answer("--top-p", "0.9")[1], re.M)  # it samples (at temperature 1.0)
    greedy, err = answer()
    assert "seed" not in err
    ask = Generator.load(str(chat_model))
    assert greedy == ask([QUESTION], 12, use_chat=False)[0]
    stop = greedy.strip()[len(greedy.strip()) // 2 :][:3]  # a text from the middle of the answer
    assert answer("--stop", stop, "--stop", "never in it")[0] == greedy[: greedy.index(stop)]
    ids = ask.encode(QUESTION, use_chat=False)
    tokens = generate(ask.model, [ids], 12, eos_ids=ask.eos_ids)[0]
    kept = answer("--stop-id", str(tokens[1]))[0]
    assert kept == ask.tokenizer.decode(tokens[: tokens.index(tokens[1]) + 1], skip_special_tokens=True)
    assert main([*asked, "--temperature", "0", "--top-k", "5"]) == 2
    assert "--temperature 0 is greedy, and --top-k 5, --top-p 1.0 choose among" in capsys.readouterr().err
    assert main([*asked, "--stop-id", "100000"]) == 2
    assert "stop id 100000 is not a token of this model" in capsys.readouterr().err
    # a flag out of its range is named alone (it was "--temperature 1.0, --top-k 0, --top-p 0.0: ...",
    # values the command had completed it with; the twenty-third walk)
    for flag, value, said in (("--top-p", "0", "--top-p 0.0: give above 0 and at most 1"),
                              ("--top-k", "-1", "--top-k -1: give 0 or more"),
                              ("--temperature", "-0.5", "--temperature -0.5: give 0 or more")):  # fmt: skip
        assert main([*asked, flag, value]) == 2
        assert said in capsys.readouterr().err


def test_sampling_takes_what_the_flags_leave_out_from_the_models_generation_config(chat_model, tmp_path, capsys):
    """The fifth walk: with `top_k: 1` in the model's generation_config.json, transformers'
    generate(temperature=1.5) answers greedily, and `xlafit generate --temperature 1.5` sampled
    from the whole vocabulary. The flags' gaps are the model's (and said); a flag wins."""
    import json
    import shutil

    from xlafit.cli import main

    folder = tmp_path / "topk1"
    shutil.copytree(chat_model, folder)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_k": 1}))
    asked = ["generate", str(folder), "--prompt", QUESTION, "--max-new-tokens", "8", "--json", "--no-chat"]

    def answer(*flags: str) -> tuple[str, str]:
        assert main([*asked, *flags]) == 0
        out, err = capsys.readouterr()
        return json.loads(out)["answer"], err

    greedy, err = answer()
    assert "greedy: the model's generation_config.json samples (temperature 0.6, top_k 1)" in err
    for seed in ("1", "2"):
        sampled, err = answer("--temperature", "1.5", "--seed", seed)
        assert sampled == greedy  # top_k 1: the likeliest token whatever the temperature
        assert "sampling with the model's generation_config.json for --top-k 1" in err
    assert "--temperature 0.6" in answer("--top-p", "0.9", "--seed", "1")[1]  # the model's temperature
    widened = {answer("--temperature", "1.5", "--top-k", "0", "--seed", str(s))[0] for s in range(3)}
    assert widened != {greedy}  # --top-k 0 samples from every token


def test_the_models_repetition_penalty_and_answer_length_are_taken_and_what_is_not_applied_is_said(
    chat_model, tmp_path, capsys
):
    """The twenty-third walk: a generation_config.json's repetition_penalty and max_new_tokens
    were dropped without a word (greedy answers then differed from transformers' generate on
    the export), the Python API sampled without the model's top_k and top_p where the command
    took them, and an empty prompt ended in a traceback."""
    import dataclasses
    import json
    import shutil

    from xlafit.cli import main
    from xlafit.errors import ConfigError
    from xlafit.generator import Generator

    folder = tmp_path / "penalised"
    shutil.copytree(chat_model, folder)
    settings = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 0.05,
                "max_new_tokens": 6, "no_repeat_ngram_size": 3}  # fmt: skip
    (folder / "generation_config.json").write_text(json.dumps(settings))
    asked = ["generate", str(folder), "--prompt", QUESTION, "--json", "--no-chat"]

    def answer(*flags: str) -> tuple[str, str]:
        assert main([*asked, *flags]) == 0
        out, err = capsys.readouterr()
        return json.loads(out)["answer"], err

    greedy, err = answer()
    assert "greedy with the model's generation_config.json for --repetition-penalty 0.05" in err
    assert "--max-new-tokens 6: the model's generation_config.json's" in err
    assert "not applied: the model's generation_config.json sets no_repeat_ngram_size 3" in err
    assert answer("--repetition-penalty", "1")[0] != greedy  # the penalty changes this model's answer
    ask = Generator.load(str(folder))
    assert ask.max_new_tokens == 6 and ask.sampling().repetition_penalty == 0.05
    assert ask([QUESTION], use_chat=False) == [greedy]  # Python takes what the command takes
    tokens = len(ask.tokenizer.encode(ask([QUESTION], 40, use_chat=False)[0], add_special_tokens=False).ids)
    assert tokens > 6 or ask([QUESTION], 40, use_chat=False) == [greedy]  # 40 asked for: the config's 6 no bound
    sampled, err = answer("--temperature", "0.9", "--seed", "5")
    assert "sampling with the model's generation_config.json for --top-k 20, --top-p 0.8" in err
    assert ask([QUESTION], sampling=ask.sampling(temperature=0.9, seed=5), use_chat=False) == [sampled]
    no_bos = dataclasses.replace(ask, bos_id=None)  # a tokenizer that puts nothing before a text
    with pytest.raises(ConfigError, match="prompt 2 is empty: no token to continue from"):
        no_bos([QUESTION, ""], use_chat=False)
    assert main([*asked, "--repetition-penalty", "0"]) == 2
    assert "--repetition-penalty 0.0: give a number above 0" in capsys.readouterr().err


def test_a_chat_records_tools_and_template_keywords_reach_the_template_as_in_training(chat_model, tmp_path, capsys):
    """The twenty-third walk: a --prompts-file record's tools and chat_template_kwargs were
    dropped (training renders them; a function-calling model was asked without its tools, Qwen3
    without enable_thinking=false). They reach the template, in the command and in Python."""
    import json
    import shutil

    from xlafit.cli import main
    from xlafit.generator import Generator

    folder = tmp_path / "tools"
    shutil.copytree(chat_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if tools %}Tools: {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
        "{% if greet %}Be nice.\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": QUESTION}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    ask = Generator.load(str(folder))
    record = {"messages": messages, "tools": tools, "chat_template_kwargs": {"greet": True}}
    text = ask.template.render(messages, True, tools=tools, greet=True)
    assert text.startswith("Tools: add\nBe nice.\n")
    assert ask.encode(record) == ask.tokenizer.encode(text, add_special_tokens=False).ids != ask.encode(messages)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(record) + "\n")
    capsys.readouterr()
    assert main(["generate", str(folder), "--prompts-file", str(prompts), "--max-new-tokens", "4", "--json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["prompt"] == record and [line["answer"]] == ask([record], 4)
    # a sampled answer's JSON line holds the seed that repeats it (it was on stderr alone)
    assert main(["generate", str(folder), "--prompts-file", str(prompts), "--max-new-tokens", "4", "--json",
                 "--temperature", "1.0"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert f"seed {json.loads(out)['seed']} (pass --seed" in err


def test_questions_of_other_lengths_run_one_compiled_program_and_answer_as_alone(chat_model):
    """The twenty-third walk: in a notebook every question of a new length compiled the decode
    loop again (3 s each for a 2-layer model here). Prompts are padded to a power of two of
    tokens: one program for a range of lengths, the answers those of the prompt alone."""
    from xlafit.generator import Generator
    from xlafit.models import generation

    ask = Generator.load(str(chat_model))
    questions = ["Hi?", "What is 3 plus 4?", "What is 9 minus 2, and why?"]
    ids = [ask.encode(q, use_chat=False) for q in questions]
    assert len({len(i) for i in ids}) == 3 and max(map(len, ids)) <= 16
    answers = [ask([questions[0]], 6, use_chat=False)]
    compiled = generation._run._cache_size()  # the first length's program (or one this process had already)
    answers += [ask([q], 6, use_chat=False) for q in questions[1:]]
    assert generation._run._cache_size() == compiled  # the other lengths ran it too
    alone = [generate(ask.model, [i], 6, eos_ids=ask.eos_ids) for i in ids]
    assert answers == [[ask.tokenizer.decode(t[0], skip_special_tokens=True)] for t in alone]


# --------------------------------------------------------------------------- asking a run that is training


def test_generate_during_training_reads_the_newest_checkpoint_that_stays_and_names_its_step(tmp_path, capsys):
    """Issue 63 (15): asked mid-run, with checkpoints rotating every step, every call failed:
    a checkpoint removed while it was read was called corrupt ("the run has to start over"),
    its metadata read after it was gone made "the base model ... is not the one its adapters
    were trained on", and asyncio printed tracebacks. Each call reads the newest checkpoint
    that stays while it is read (looking again when one is removed) and names its step."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from xlafit.cli import main

    run = tmp_path / "run"
    keep = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env = keep | {"PYTHONUNBUFFERED": "1", "XLAFIT_CACHE": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    # The suite's XLA:CPU optimisation level (conftest.py), not its devices: this process
    # re-initialises the run's new base to check it, and another optimisation level rounds the
    # initialisation otherwise (refused, rightly, as another base).
    env["XLA_FLAGS"] = " ".join(f for f in os.environ["XLA_FLAGS"].split() if "optimization_level" in f)
    train = [
        sys.executable, "-m", "xlafit", "train", "llm", "--simulate", "1", "--run-dir", str(run),
        "lora.rank=4", "data.vocab_size=400", "data.seq_len=64", "data.global_batch=8",
        "trainer.stop_at_step=100000", "trainer.log_every_steps=1", "trainer.checkpoint_every_steps=1",
        "trainer.keep_checkpoints=1", "trainer.eval_every_epochs=100",
    ]  # fmt: skip
    proc = subprocess.Popen(train, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while not any(p.name.isdigit() for p in (run / "checkpoints").glob("*")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.5)
        capsys.readouterr()
        steps = []
        for _ in range(3):
            code = main(["generate", str(run), "--prompt", "대한민국은", "--max-new-tokens", "3", "--json"])
            assert code == 0, capsys.readouterr().err[-3000:]
            assert proc.poll() is None  # asked while it trains
            out, err = capsys.readouterr()
            assert "Traceback" not in err and "corrupt" not in err and "base model" not in err, err
            answer = json.loads(out.strip().splitlines()[-1])
            steps.append(answer["step"])
            assert f"answering from step {answer['step']} of {run}" in err, err
        saved = sorted(int(p.name) for p in (run / "checkpoints").glob("*") if p.name.isdigit())
        assert steps == sorted(steps) and steps[-1] < saved[-1], (steps, saved)  # the run went on meanwhile
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)


def test_a_run_from_a_relative_model_path_generates_and_exports_from_any_directory(chatml_run, tmp_path, monkeypatch):
    """The third walk: a LoRA run started with model.init_from_hf=exports/base (relative, as the
    guides write it) recorded the path as typed, and `xlafit generate` / `export` from any other
    directory took it for a hub id ("hf download exports/base"). The run records it absolute; a
    run directory that holds it relative says to run from where the run started, and resumes there."""
    import yaml

    import xlafit
    from xlafit.errors import ConfigError
    from xlafit.export import export_hf
    from xlafit.generator import Generator
    from xlafit.recipes import llm_data, load_config

    export_hf(chatml_run, tmp_path / "exports" / "base")
    monkeypatch.chdir(tmp_path)
    overrides = [
        "run.run_dir=runs/tuned", "model.init_from_hf=exports/base", "lora.rank=4",
        f"data.data_dir={chatml_run.parent / 'chat.jsonl'}", "data.seq_len=64", "trainer.eval_every_epochs=100",
    ]  # fmt: skip
    xlafit.train_and_evaluate(load_config("llm", [*overrides, "trainer.stop_at_step=1"]))
    config = tmp_path / "runs" / "tuned" / "config.yaml"
    assert yaml.safe_load(config.read_text())["model"]["init_from_hf"] == str(tmp_path / "exports" / "base")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    llm_data._resolved.cache_clear()  # each command is a process of its own: nothing resolved before it
    assert Generator.load(str(tmp_path / "runs" / "tuned")).step == 1
    saved = yaml.safe_load(config.read_text())
    saved["model"]["init_from_hf"] = "exports/base"  # relative, as a run directory may hold it
    config.write_text(yaml.safe_dump(saved, sort_keys=False))
    with pytest.raises(ConfigError, match=r"records model.init_from_hf=exports/base as it was given: if that is a"):
        export_hf(tmp_path / "runs" / "tuned", tmp_path / "tuned-hf")
    monkeypatch.chdir(tmp_path)  # where the run started: its relative path resumes as the same setting
    llm_data._resolved.cache_clear()
    xlafit.train_and_evaluate(load_config("llm", [*overrides, "trainer.stop_at_step=2"]))
    assert Generator.load("runs/tuned").step == 2
    # The twenty-third walk: a base moved away since was "no such file or directory", with no word
    # that it is the run's recorded base nor how to point to its new place
    (tmp_path / "exports" / "base").rename(tmp_path / "exports" / "moved")
    llm_data._resolved.cache_clear()
    with pytest.raises(
        ConfigError, match=r"It is the model runs/tuned started from \(model.init_from_hf in runs/tuned/"
    ):
        Generator.load("runs/tuned")


def test_a_full_fine_tune_generates_and_exports_after_its_base_is_gone(chatml_run, tmp_path):
    """The twenty-third walk: a full fine-tune's checkpoints hold every weight, yet generate and
    export read its base's config.json (and its weights, to overwrite them), so a base deleted
    or moved since left the run unusable. The run keeps the base's config.json; the model is
    made from it alone, the same export and the same answers with the base gone."""
    import json
    import shutil

    from safetensors.numpy import load_file

    import xlafit
    from xlafit.export import export_hf
    from xlafit.generator import Generator
    from xlafit.recipes import llm_data, load_config

    export_hf(chatml_run, tmp_path / "base")
    run = tmp_path / "run"
    overrides = [
        f"run.run_dir={run}", f"model.init_from_hf={tmp_path / 'base'}",
        f"data.data_dir={chatml_run.parent / 'chat.jsonl'}",
        "data.seq_len=64", "data.global_batch=16", "trainer.epochs=1", "trainer.eval_every_epochs=1",
    ]  # fmt: skip
    xlafit.train_and_evaluate(load_config("llm", overrides))
    # scored without reading the base's weights (made from its config.json): the run's own evaluation
    (tmp_path / "base" / "model.safetensors").rename(tmp_path / "weights.safetensors")
    (record,) = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "eval"]
    (score,) = xlafit.evaluate_run(str(run))
    assert score.step == record["step"] and score.metrics["loss"] == pytest.approx(record["loss"], rel=1e-6)
    (tmp_path / "weights.safetensors").rename(tmp_path / "base" / "model.safetensors")
    assert json.loads((run / llm_data.BASE_CONFIG).read_text()) == json.loads(
        (tmp_path / "base" / "config.json").read_text()
    )
    export_hf(run, tmp_path / "before")
    before = Generator.load(str(run))([QUESTION], max_new_tokens=6)
    shutil.rmtree(tmp_path / "base")
    llm_data._resolved.cache_clear()
    export_hf(run, tmp_path / "after")
    weights = [load_file(tmp_path / d / "model.safetensors") for d in ("before", "after")]
    assert weights[0].keys() == weights[1].keys()
    assert all(np.array_equal(weights[0][k], weights[1][k]) for k in weights[0])
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        before_file, after_file = (json.loads((tmp_path / d / name).read_text()) for d in ("before", "after"))
        assert before_file == after_file, name
    assert Generator.load(str(run))([QUESTION], max_new_tokens=6) == before


def test_a_conversation_ending_with_the_assistants_turn_is_continued_as_transformers_continues_it(chatml_run, tmp_path):
    """The fourth walk: a --prompts-file conversation ending with the assistant's turn (the run's
    own chat data) got a new assistant turn after the answer. It is continued from that turn's
    text, with the ids transformers' apply_chat_template(continue_final_message=True) gives."""
    transformers = pytest.importorskip("transformers")  # the pinned suite's; the newest venv has none
    from xlafit.cli.generate import _shown
    from xlafit.export import export_hf
    from xlafit.generator import Generator

    export_hf(chatml_run, tmp_path / "hf")
    ask = Generator.load(str(tmp_path / "hf"))
    conversation = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "3 plus"}]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    theirs = hf_tok.apply_chat_template(conversation, continue_final_message=True)
    assert ask.encode(conversation) == list(theirs if isinstance(theirs, list) else theirs["input_ids"])
    assert ask.encode(conversation) != ask.encode(conversation[:1])
    assert _shown(conversation) == "What is 3 plus 4? [continuing: 3 plus]"


def test_a_run_whose_mesh_does_not_fit_here_is_answered_replicated_naming_its_mesh(chatml_run, tmp_path, capsys):
    """The seventh walk: a run trained on a mesh this host cannot make was answered replicated,
    and the note repeated the mesh error's advice (mesh.data=-1 mesh.fsdp=1 ...), keys that
    `generate` does not take. It names the run's mesh and what replication changes."""
    import shutil

    import yaml

    from xlafit.generator import Generator

    run = tmp_path / "run"
    shutil.copytree(chatml_run, run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["mesh"] |= {"data": 1, "fsdp": 16}  # more devices than the suite's eight
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    ask = Generator.load(str(run))
    err = capsys.readouterr().err
    assert "the run's mesh (mesh.fsdp=16) does not fit this host's 8 device(s): the model is replicated" in err, err
    assert "For example" not in err and "mesh.tensor=" not in err, err
    assert len(ask(["What is 1 plus 2?"], max_new_tokens=2)) == 1
