"""xlafit's training chat templates (xlafit.data.templates): a tokenizer carrying Qwen3's or
Mistral v0.3's official template (tests/chat_templates/, the text of the models'
tokenizer_config.json) trains on chat records with the shipped template in its place: the loss
on exactly the assistant answers, each answer the tokens the official template gives it when it
is the last turn (what the model generates at inference)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xlafit.data import clm, rendering, templates
from xlafit.errors import DataError
from xlafit.recipes import llm, llm_data, load_config

OFFICIAL = Path(__file__).parent / "chat_templates"
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "<think>\nThe capital is Paris.\n</think>\n\nParis."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, since 1871."},
    {"role": "user", "content": "And of Spain?"},
    {"role": "assistant", "content": "Madrid.", "reasoning_content": "Madrid, since 1561."},
]
FAMILIES = {  # the special tokens of each family's tokenizer_config.json, and its added tokens
    "qwen3": ({"eos_token": "<|im_end|>"}, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
              ["<think>", "</think>"]),
    "mistral-v0.3": ({"bos_token": "<s>", "eos_token": "</s>"}, ["<s>", "</s>", "[INST]", "[/INST]"], []),
}  # fmt: skip


def _model_dir(root: Path, family: str) -> Path:
    """A tokenizer trained here with the family's special tokens and official chat template."""
    tokens, specials, added = FAMILIES[family]
    folder = root / family
    folder.mkdir()
    corpus = folder / "corpus.txt"
    text = [str(m.get("content", "")) + " " + str(m.get("reasoning_content", "")) for m in CONVERSATION]
    corpus.write_text("\n".join(text * 20))
    tok = clm.train_bpe([corpus], vocab_size=300, out=folder)
    tok.add_special_tokens(specials)
    tok.add_tokens(added)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}
    config["chat_template"] = (OFFICIAL / f"{family}.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: _model_dir(root, family) for family in FAMILIES}


def _official(folder: Path):
    """The directory's tokenizer in transformers, with its official template."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _ids(hf, messages, **kw) -> list[int]:
    return list(hf.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])


def _runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The stretches of ids the mask counts, in order."""
    runs: list[list[int]] = []
    for i, (token, counted) in enumerate(zip(ids, mask, strict=True)):
        if counted:
            if not i or not mask[i - 1]:
                runs.append([])
            runs[-1].append(token)
    return runs


def _record(train) -> tuple[list[int], list[int]]:
    """The one record's ids and loss mask, from its packed row."""
    at = train.arrays["segment_ids"][0] == 1
    return train.arrays["input_ids"][0][at].tolist(), train.arrays["loss_mask"][0][at].tolist()


def _train(folder: Path, tmp_path: Path, *overrides: str):
    """The llm recipe's data for one chat record (eval_fraction=0), as a run reads it."""
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    cfg = load_config(
        "llm",
        [f"data.data_dir={data}", f"data.tokenizer={folder}", "data.seq_len=512", "data.eval_fraction=0", *overrides],
    )
    train, _ = llm_data.load_data(cfg)
    return cfg, train


def test_the_official_templates_are_recognised_and_refused_as_they_are(dirs):
    """The fixtures are the official templates: recognised, and without the swap their answers
    cannot be found (the refusal names the shipped templates and {% generation %})."""
    tok = clm.load_tokenizer(dirs["qwen3"])
    for family, folder in dirs.items():
        official = rendering.template_for(str(folder))
        assert official is not None and templates.recognise(official.source) == templates.by_name(family)
        with pytest.raises(DataError) as e:
            official.answer_spans(CONVERSATION)
        message = str(e.value)
        assert "data.chat_template=qwen3 for Qwen3, data.chat_template=mistral-v0.3 for Mistral v0.3" in message
        assert "{% generation %}" in message and "\n" not in message
    assert rendering.end_of_turn(rendering.template_for(str(dirs["qwen3"]), training=True), tok) == "<|im_end|>"


def test_qwen3_trains_on_every_answer_as_the_model_generates_it(dirs, tmp_path, capsys):
    """The official Qwen3 template drops earlier turns' reasoning, so the run refused the data;
    with the training template each answer (its <think> block, an empty one where it has none,
    to <|im_end|>) is what the official template renders for it as the last turn, and the last
    question with its answer are the official template's tokens."""
    folder = dirs["qwen3"]
    _, train = _train(folder, tmp_path)
    assert "chat template: xlafit's training template for Qwen3 (data.chat_template=qwen3), in place of the chat " \
           "template of" in capsys.readouterr().err  # fmt: skip
    ids, mask = _record(train)
    hf, tok = _official(folder), clm.load_tokenizer(folder)
    answers = []
    for i, message in enumerate(CONVERSATION):
        if message["role"] == "assistant":
            asked = _ids(hf, CONVERSATION[:i], add_generation_prompt=True)
            answered = _ids(hf, CONVERSATION[: i + 1])
            assert answered[: len(asked)] == asked  # the official template, this turn the last
            assert tok.decode(answered[-1:]) == "\n"  # after <|im_end|>: the model stops before it
            answers.append(answered[len(asked) : -1])
    assert _runs(ids, mask) == answers
    assert tok.decode(answers[1], skip_special_tokens=False) == "<think>\n\n</think>\n\nRome, since 1871.<|im_end|>"
    # The last question and its answer: the official template's own tokens for the conversation.
    official = _ids(hf, CONVERSATION)
    start = tok.token_to_id("<|im_start|>")
    last_question = [i for i, t in enumerate(official) if t == start][-2]
    tail = official[last_question:]
    assert ids[-len(tail) :] == tail and sum(mask[: len(ids) - len(tail)]) == sum(map(len, answers[:-1]))


def test_mistral_trains_with_the_system_prompt_where_the_model_is_asked(dirs, tmp_path):
    """The official Mistral v0.3 template keeps the system prompt only where the last message is
    the user's, so it refused the data (on the whole conversation it drops the prompt); with the
    training template the tokens are the official template's for the last question, then the
    answer, and each answer is what the official one renders for it."""
    folder = dirs["mistral-v0.3"]
    _, train = _train(folder, tmp_path)
    ids, mask = _record(train)
    hf, tok = _official(folder), clm.load_tokenizer(folder)
    asked = _ids(hf, CONVERSATION[:-1], add_generation_prompt=True)  # what the model sees at inference
    assert "You answer briefly." in tok.decode(asked, skip_special_tokens=False)
    answers = []
    close = tok.token_to_id("[/INST]")
    for i, message in enumerate(CONVERSATION):
        if message["role"] == "assistant":
            answered = _ids(hf, CONVERSATION[: i + 1])
            answers.append(answered[len(answered) - answered[::-1].index(close) :])
    assert _runs(ids, mask) == answers
    assert ids == asked + answers[-1]
    assert tok.decode(answers[-1], skip_special_tokens=False).endswith("Madrid.</s>")


def test_a_given_template_wins_and_a_shipped_one_is_chosen_by_name(dirs, tmp_path, capsys):
    folder = dirs["qwen3"]
    mine = tmp_path / "mine.jinja"
    mine.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n"
        "{% endfor %}"
    )
    given = rendering.template_for(str(folder), str(mine), training=True)
    assert given is not None and given.shipped is None and given.source == mine.read_text()
    _, train = _train(folder, tmp_path, f"data.chat_template={mine}")
    assert f"chat template: the chat template in {mine} (data.chat_template)" in capsys.readouterr().err
    named = rendering.template_for(str(dirs["mistral-v0.3"]), "qwen3")
    assert named is not None and named.shipped == templates.by_name("qwen3") and named.official is None
    assert named.source == templates.source(templates.by_name("qwen3"))
    # Asked through the template (generation, a directory's own): the official one, unchanged.
    own = rendering.template_for(str(folder))
    assert own is not None and own.shipped is None and own.source == (OFFICIAL / "qwen3.jinja").read_text()


def test_a_recognised_template_that_renders_otherwise_is_kept(dirs, monkeypatch):
    """Recognition is by the template's lines; a template that asks a question otherwise than
    the training template would is not swapped (here: ChatML, made to look like Qwen3's)."""
    folder = dirs["qwen3"]
    other = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    disguised = folder.parent / "disguised"
    disguised.mkdir()
    (disguised / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    (disguised / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": other}))
    qwen3 = templates.by_name("qwen3")
    looks_alike = templates.Shipped(qwen3.name, qwen3.family, qwen3.why, (templates.digest(other),))
    monkeypatch.setattr(templates, "SHIPPED", (looks_alike,))
    kept = rendering.template_for(str(disguised), training=True)
    assert kept is not None and kept.source == other and kept.official is None


def test_the_run_records_the_template_and_keeps_the_official_one(dirs, tmp_path):
    folder = dirs["qwen3"]
    cfg, train = _train(folder, tmp_path)
    run = tmp_path / "run"
    llm.RECIPE.save_artifacts(cfg, run, train)
    recorded = json.loads((run / llm_data.DATA_FORMAT_FILE).read_text())
    assert recorded["format"] == "chat" and recorded["chat_template"]["shipped"] == "qwen3"
    assert recorded["chat_template"]["in_place_of"].endswith("tokenizer_config.json")
    # The tokenizer the run keeps (for generation and export) carries the official template.
    assert (run / "tokenizer" / rendering.TEMPLATE_FILE).read_text() == (OFFICIAL / "qwen3.jinja").read_text()
    tokens = json.loads((run / "tokenizer" / "tokenizer_config.json").read_text())
    assert tokens["eos_token"] == "<|im_end|>"


def test_the_shipped_templates_are_package_data():
    for shipped in templates.SHIPPED:
        text = templates.source(shipped)
        assert "{%- generation %}" in text and rendering.ChatTemplate(text).marks_generation
        assert templates.recognise(text) is None  # a training template is not an official one
