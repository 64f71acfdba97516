"""Chat and instruction data (xlafit.data.chat): the template renders as Hugging Face's does
(the same token ids), the loss counts the answers only, and records pack into rows."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from helpers import long_form
from xlafit.data import chat, clm, rendering
from xlafit.errors import ConfigError, DataError
from xlafit.recipes import llm_data, load_config

# The command as a user runs it: without the suite's XLA_FLAGS (8 host devices), on the CPU.
USER_ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, since 1871."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tokenizer trained here with a chat model's special tokens, as a model directory."""
    root = tmp_path_factory.mktemp("chat-model")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(m["content"] for m in CONVERSATION * 20) + "\nThe answer is short.\n" * 20)
    tok = clm.train_bpe([corpus], vocab_size=300, out=root)
    tok.add_special_tokens(SPECIALS)
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"}
    (root / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    return root


def _hf(model_dir, template):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    tok.chat_template = template
    return tok


def test_token_ids_and_answer_mask_equal_transformers_apply_chat_template(model_dir):
    hf = _hf(model_dir, CHATML)
    expected = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    tok = clm.load_tokenizer(model_dir)
    template = rendering.template_for(str(model_dir))
    assert template is not None and template.marks_generation
    got = chat.encode({"messages": CONVERSATION}, "chat", tok, template)
    assert got.ids == list(expected["input_ids"])
    assert got.mask == list(expected["assistant_masks"])
    assert sum(got.mask) > 0


def test_a_conversational_prompt_completion_record_is_encoded_as_trl_encodes_it(model_dir):
    """The sixth walk: TRL's conversational prompt/completion ({"prompt": [messages],
    "completion": [messages]}) was refused ("'prompt' must be text"). Its ids are the whole
    conversation in the chat template, its loss on what the completion adds to the prompt
    rendered with its generation prompt (TRL's SFTTrainer's completion mask)."""
    hf = _hf(model_dir, CHATML)
    prompt, completion = CONVERSATION[:-1], CONVERSATION[-1:]  # a system turn, then a question and an answer
    whole = list(hf.apply_chat_template([*prompt, *completion], tokenize=True, return_dict=True)["input_ids"])
    asked = hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    tok, template = clm.load_tokenizer(model_dir), rendering.template_for(str(model_dir))
    got = chat.encode({"prompt": prompt, "completion": completion}, "prompt_completion", tok, template)
    assert got.ids == whole
    assert got.mask == [0] * len(asked) + [1] * (len(whole) - len(asked)) and not got.spans_boundary


def test_without_generation_marks_the_answers_are_what_each_turn_adds(model_dir):
    """Llama 3's template marks nothing: each assistant turn is what rendering up to it adds to
    rendering before it with the generation prompt; the prompt's header stays out of the loss,
    the turn's <|eot_id|> in."""
    tok = clm.load_tokenizer(model_dir)
    template = rendering.ChatTemplate(LLAMA3, {"bos_token": "<|begin_of_text|>"})
    got = chat.encode({"messages": CONVERSATION}, "chat", tok, template)
    hf = _hf(model_dir, LLAMA3)
    assert got.ids == list(hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"])
    # The hand-written expectation: the tokens of each answer and its <|eot_id|>, nothing else.
    expected = []
    for m in CONVERSATION:
        header = tok.encode(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", add_special_tokens=False).ids
        content = tok.encode(m["content"], add_special_tokens=False).ids + [tok.token_to_id("<|eot_id|>")]
        expected += [0] * len(header) + [int(m["role"] == "assistant")] * len(content)
    assert got.mask == [0] + expected  # <|begin_of_text|> first
    all_tokens = chat.encode({"messages": CONVERSATION}, "chat", tok, template, loss_on="all")
    assert all_tokens.mask == [1] * len(got.ids)


def test_a_template_whose_answers_cannot_be_found_trains_every_token_with_loss_on_all(model_dir):
    """The eighth walk: a template that renders the last answer differently (as official ones
    that drop earlier turns' reasoning do) is refused with "... or data.loss_on=all", and
    data.loss_on=all was refused the same way: the answers were looked for whatever loss_on
    said. With every token counted, the conversation is rendered whole, as transformers
    renders it (TRL's SFTTrainer without assistant_only_loss)."""
    last_differs = (
        "{% for m in messages %}{% if m.role == 'user' %}### User: {{ m.content }}\n{% else %}### Assistant: "
        "{% if loop.last %}[final] {% endif %}{{ m.content }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}### Assistant: {% endif %}"
    )
    tok = clm.load_tokenizer(model_dir)
    template = rendering.ChatTemplate(last_differs)
    with pytest.raises(DataError, match="renders a conversation differently from its beginning"):
        chat.encode({"messages": CONVERSATION}, "chat", tok, template)
    got = chat.encode({"messages": CONVERSATION}, "chat", tok, template, loss_on="all")
    hf = _hf(model_dir, last_differs)
    assert got.ids == list(hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"])
    assert got.mask == [1] * len(got.ids)


def test_the_end_of_an_assistant_turn_is_the_special_token_after_the_answer(model_dir):
    tok = clm.load_tokenizer(model_dir)
    assert rendering.end_of_turn(rendering.ChatTemplate(CHATML), tok) == "<|im_end|>"
    llama3 = rendering.ChatTemplate(LLAMA3, {"bos_token": "<|begin_of_text|>"})
    assert rendering.end_of_turn(llama3, tok) == "<|eot_id|>"
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    assert rendering.end_of_turn(rendering.ChatTemplate(plain), tok) is None  # no special token ends a turn
    user_only = (
        "{% for m in messages %}{% if m['role'] != 'user' %}{{ raise_exception('users only') }}{% endif %}{% endfor %}"
    )
    assert rendering.end_of_turn(rendering.ChatTemplate(user_only), tok) is None


def test_prompt_completion_counts_the_completion_and_its_end(model_dir):
    tok = clm.load_tokenizer(model_dir)
    got = chat.encode(
        {"prompt": "The answer", "completion": " is short."}, "prompt_completion", tok, None, bos=0, eos=1
    )
    prompt = tok.encode("The answer", add_special_tokens=False).ids
    completion = tok.encode(" is short.", add_special_tokens=False).ids
    assert got.ids == [0, *prompt, *completion, 1]
    assert got.mask == [0] * (1 + len(prompt)) + [1] * (len(completion) + 1)


def test_records_are_detected_packed_and_their_masks_follow_them(model_dir, tmp_path):
    lines = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:3]}] * 10
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines))
    tok = clm.load_tokenizer(model_dir)
    template = rendering.template_for(str(model_dir))
    train, evaluation = clm.load_packed([str(path)], tok, seq_len=128, eval_fraction=0.2, seed=1, template=template)
    assert train.source.format == "chat" and train.documents + evaluation.documents == 20 and evaluation.documents
    assert set(train.arrays) == {"input_ids", "segment_ids", "positions", "loss_mask"}
    single = chat.encode({"messages": CONVERSATION}, "chat", tok, template)
    # Every packed segment is one record: its mask is that record's, and nothing crosses records.
    ids, seg, mask = (train.arrays[k] for k in ("input_ids", "segment_ids", "loss_mask"))
    for row in range(len(ids)):
        for s in range(1, seg[row].max() + 1):
            at = seg[row] == s
            if at.sum() == len(single.ids):
                assert ids[row][at].tolist() == single.ids and mask[row][at].tolist() == single.mask
    _, weights = clm.next_token_targets(ids, seg, mask)
    assert weights.sum() > 0 and (weights <= (mask[:, 1:] > 0)).all()
    assert 0 < train.source.answer_share < 0.5


def test_bad_records_are_one_clear_error(model_dir, tmp_path):
    tok = clm.load_tokenizer(model_dir)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2 is not JSON"):
        chat.read_records([str(bad)])
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"question": "a", "answer": "b"}\n')
    with pytest.raises(
        DataError, match=r"has no column 'text' \(it has answer, question\) .* neither chat .* prompt_comp"
    ):
        clm.load_packed([str(odd)], tok, seq_len=64)
    half = tmp_path / "pc.jsonl"  # a conversation for a prompt, a text for a completion: one kind or the other
    half.write_text(json.dumps({"prompt": CONVERSATION[1:2], "completion": "It is Paris."}) + "\n")
    with pytest.raises(DataError, match=r"'prompt' must be text; .* gives its prompt and its completion both as"):
        clm.load_packed([str(half)], tok, seq_len=64)
    with pytest.raises(DataError) as no_template:
        chat.encode({"messages": CONVERSATION}, "chat", tok, None)
    assert str(no_template.value) == (  # the seventeenth walk: it named neither the shipped templates nor text
        "chat records need a chat template, and the tokenizer's directory has none (tokenizer_config.json's "
        "chat_template or chat_template.jinja): give one as data.chat_template, a Jinja file or one xlafit ships "
        "(data.chat_template=qwen3 for Qwen3, data.chat_template=mistral-v0.3 for Mistral v0.3); or, where the "
        "records hold a text column too, train on that text as it is with data.format=text."
    )
    with pytest.raises(DataError, match="data.format='dialog'"):
        clm.load_packed([str(odd)], tok, seq_len=64, fmt="dialog")


def test_text_records_without_text_are_named_and_left_out_and_text_that_is_no_text_is_refused(
    model_dir, tmp_path, caplog
):
    """The sixth walk: text records whose text was null or empty were dropped without a word, and
    one whose text was a number ended in a tokenizers TypeError naming no file or record."""
    import logging

    tok = clm.load_tokenizer(model_dir)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["The answer is short.", None, "", "Paris."]))
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        encoded, fmt = clm.encode_files([str(texts)], tok, "auto", "text", None, "assistant", (None, None))
    assert fmt == "text" and len(encoded) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"warning: {texts}: 2 records have no text in 'text' (null or empty): left out"
    ]
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["Fine.", 12345]))
    with pytest.raises(DataError, match=r"texts.jsonl, record 2: its .text. is 12345 \(of type int\), not text; give"):
        clm.encode_files([str(texts)], tok, "auto", "text", None, "assistant", (None, None))


def test_mixed_formats_name_a_file_of_each(model_dir, tmp_path):
    """The sixth walk: "the inputs mix formats (chat, text)" named data.format, which fixes nothing."""
    tok = clm.load_tokenizer(model_dir)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CONVERSATION[1:3]}) + "\n")
    (tmp_path / "notes.txt").write_text("The answer is short.\n")
    with pytest.raises(DataError, match=r"mix formats \(.*chat.jsonl is chat, .*notes.txt is text\); give one kind"):
        clm.load_packed([str(tmp_path)], tok, seq_len=64, template=rendering.template_for(str(model_dir)))


TOOL_CALL = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
PARTS = {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}


@pytest.mark.parametrize(
    "name, content, error",
    [
        ("latin1.jsonl", json.dumps({"messages": CONVERSATION[1:3]}).replace("France", "Fr\u00e4nce").encode("latin-1"),
         r"latin1.jsonl:1 is not UTF-8 text \(byte \d+\); convert the file with iconv"),
        ("bad.parquet", b"not a parquet file at all",
         r"bad.parquet is not a Parquet file \(.*\); give Parquet files, or name the file for what it holds"),
        ("null.jsonl", json.dumps({"messages": [CONVERSATION[1], {"role": "assistant", "content": None}]}).encode(),
         r"null.jsonl, record 1 \(read as chat\): a message of role 'assistant' has content null; give its content"),
        ("number.jsonl", json.dumps({"messages": [{"role": "user", "content": 42}]}).encode(),
         r"number.jsonl, record 1 .*: a message of role 'user' has content 42; give its content as text, or a list"),
        # Accepted as transformers' templates take them, and this template joins strings: one line, not a TypeError.
        ("tools.jsonl", json.dumps({"messages": [CONVERSATION[1], TOOL_CALL]}).encode(),
         r"tools.jsonl, record 1 .*: the chat template .*cannot render a conversation \(TypeError: .*\); a template"),
        ("parts.jsonl", json.dumps({"messages": [PARTS, CONVERSATION[2]]}).encode(),
         r"parts.jsonl, record 1 .*cannot render .*handles null content or lists of parts \(data.chat_template\)"),
    ],
    ids=["latin-1", "not-parquet", "null-content", "number-content", "tool-call", "text-parts"],
)  # fmt: skip
def test_a_file_or_record_that_cannot_be_read_is_one_error_naming_it(model_dir, tmp_path, name, content, error):
    (tmp_path / name).write_bytes(content)
    tok = clm.load_tokenizer(model_dir)
    with pytest.raises(DataError, match=error) as e:
        clm.load_packed([str(tmp_path / name)], tok, seq_len=128, template=rendering.template_for(str(model_dir)))
    assert "\n" not in str(e.value)


def test_a_template_that_breaks_is_named_with_its_file_and_not_blamed_on_the_content(model_dir, tmp_path):
    """A template with a syntax error was reported without its file or line; one that fails
    on text content (endless recursion, a huge range) was told the content must be text."""
    tok = clm.load_tokenizer(model_dir)
    record = {"messages": CONVERSATION[1:3]}
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(DataError) as e:
        rendering.template_for(str(model_dir), str(tmp_path / "broken.jinja"))
    broken = tmp_path / "broken.jinja"
    assert str(e.value).startswith(f"the chat template in {broken} (data.chat_template) does not parse")
    assert "(line 2: unexpected '}')" in str(e.value)
    for source in ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "{% for i in range(10**9) %}{% endfor %}"):
        (tmp_path / "bad.jinja").write_text(source)
        template = rendering.template_for(str(model_dir), str(tmp_path / "bad.jinja"))
        with pytest.raises(DataError, match=r"bad.jinja \(data.chat_template\) cannot render a conversation") as e:
            chat.encode(record, "chat", tok, template)
        assert str(e.value).endswith("fix the template, or give another as data.chat_template.")


def test_text_parts_go_to_the_template_as_transformers_gives_them(model_dir):
    """OpenAI-style parts reach the template unchanged, as in apply_chat_template: a template
    that iterates them renders the same token ids as transformers'."""
    parts = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    )
    conversation = [PARTS, CONVERSATION[2]]
    tok = clm.load_tokenizer(model_dir)
    got = chat.encode({"messages": conversation}, "chat", tok, rendering.ChatTemplate(parts))
    expected = _hf(model_dir, parts).apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
    assert got.ids == list(expected) and sum(got.mask) > 0


def test_records_that_would_train_on_nothing_are_refused_by_name(model_dir, tmp_path):
    tok = clm.load_tokenizer(model_dir)
    template = rendering.template_for(str(model_dir))
    typo = [{**m, "role": "assistent"} if m["role"] == "assistant" else m for m in CONVERSATION]
    path = tmp_path / "typo.jsonl"
    path.write_text("\n".join(json.dumps({"messages": c}) for c in [CONVERSATION, typo]))
    with pytest.raises(DataError, match=r"typo.jsonl, record 2 \(read as chat\): .*role 'assistent' is not one of"):
        clm.load_packed([str(path)], tok, seq_len=128, template=template)
    empty = tmp_path / "empty.jsonl"  # it was counted as a record
    empty.write_text(json.dumps({"messages": CONVERSATION}) + '\n{"messages": []}\n')
    with pytest.raises(DataError, match=r"empty.jsonl, record 2 \(read as chat\): .*messages are an empty list"):
        clm.load_packed([str(empty)], tok, seq_len=128, template=template)
    # Every record without an answer: the loss would count no token.
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps({"messages": CONVERSATION[:1]}) for _ in range(10)))
    with pytest.raises(DataError, match=r"no token of .*questions.jsonl counts for the loss.*data.loss_on=all"):
        clm.load_packed([str(questions)], tok, seq_len=128, eval_fraction=0.0, template=template)
    # Answers there, but every record cut at data.seq_len before its answer: raise data.seq_len, not check roles.
    long = tmp_path / "long.jsonl"
    long.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(10)))
    with pytest.raises(DataError, match=r"every training record with an answer \(10\) is cut at data.seq_len=8 before"):
        clm.load_packed([str(long)], tok, seq_len=8, eval_fraction=0.0, template=template)
    # A chat file read as prompt/completion names the file, the record and the keys it has.
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": CONVERSATION}))
    keys = r"'prompt' must be text; it has none \(its keys are messages"
    with pytest.raises(DataError, match=rf"chats.jsonl, record 1 .*{keys}"):
        clm.load_packed([str(chats)], tok, seq_len=128, fmt="prompt_completion")


def test_tokenizing_says_how_far_it_is(model_dir, tmp_path, monkeypatch, capsys):
    """A large file is tokenized for minutes: the run prints where it is, on stderr with the
    recipe's other notes (here at every record: PROGRESS_EVERY_S=0)."""
    from xlafit.recipes import llm_data, load_config

    monkeypatch.setattr(clm, "PROGRESS_EVERY_S", 0.0)
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(12)))
    (tmp_path / "a.txt").write_text("one document\n\nand another\n")
    lines: list[str] = []
    template = rendering.template_for(str(model_dir))
    clm.load_packed([str(path)], clm.load_tokenizer(model_dir), seq_len=128, template=template, progress=lines.append)
    assert lines[0] == f"tokenizing {path} (file 1 of 1): 1 of 12 records" and lines[-1].endswith(": 12 of 12 records")
    llm_data.load_data(load_config("llm", [f"data.data_dir={tmp_path / 'a.txt'}", f"data.tokenizer={model_dir}"]))
    assert f"tokenizing {tmp_path / 'a.txt'}: 2 of 2 documents\n" in capsys.readouterr().err


def test_a_downloaded_template_cannot_reach_python():
    template = rendering.ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|access"):
        template.render([{"role": "user", "content": "x"}])
    raising = rendering.ChatTemplate("{{ raise_exception('only user and assistant roles') }}")
    with pytest.raises(DataError, match="only user and assistant roles"):
        raising.render([])


def test_masks_land_where_packing_put_their_sequences():
    placement = np.array([[0, 0], [1, 0], [0, 3]])
    out = chat.masks_in_rows([[1, 0, 1], [1, 1], [0, 1]], placement, (2, 6))
    assert out.tolist() == [[1, 0, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0]]


@long_form(
    60,
    "the notebooks' tests (tests/test_notebooks.py: LoRA on the chat demo with the loss on the answers, a run "
    "exported and asked) and test_generation's runs asked as they trained",
)
def test_the_chat_demo_tunes_a_model_whose_answers_follow(tmp_path):
    """`make demo-chat` in small: pretrain on plain text, LoRA on conversations (the loss on
    the answers falling), then ask the tuned run in ChatML."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {
        "XLAFIT_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    xlafit = [sys.executable, "-m", "xlafit"]

    def run(*args):
        done = subprocess.run([*xlafit, *args], capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    base, tuned = tmp_path / "base", tmp_path / "lora"
    # One device, where the demo simulates 8: the same batches, and the same numbers to the last
    # bit (the data-parallel split changes no result), compiled without partitioning over 8.
    run("train", "llm", "--simulate", "1", "--run-dir", str(base), "data.demo=arithmetic", "data.seq_len=96",
        "trainer.epochs=3", "optimizer.learning_rate=0.006")  # fmt: skip
    run("export", "hf", str(base), "--out", str(tmp_path / "base-hf"))
    lora = ["lora.rank=8", "lora.alpha=16", "lora.targets=q_proj,v_proj,gate_proj,up_proj,down_proj"]
    # One epoch (49 steps): the logged loss 2.18 -> 1.47 (a second epoch only takes it on to 1.40).
    trained = run(
        "train", "llm", "--simulate", "1", "--run-dir", str(tuned), f"model.init_from_hf={tmp_path / 'base-hf'}",
        "data.demo=chat", "data.seq_len=96", *lora, "trainer.epochs=1", "optimizer.learning_rate=0.01",
    )  # fmt: skip
    assert "loss on the answers:" in trained.stderr
    logged = [json.loads(line) for line in (tuned / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in logged if m.get("split") == "train"]
    assert losses[-1] < 0.8 * losses[0]  # the loss on the answers falls
    assert (tuned / "tokenizer" / rendering.TEMPLATE_FILE).exists()
    answer = run("generate", str(tuned), "--simulate", "1", "--prompt", "What is 3 plus 4?", "--max-new-tokens", "12",
                 "--json")  # fmt: skip
    (line,) = [json.loads(x) for x in answer.stdout.splitlines() if x.startswith("{")]
    # An answer in the conversations' form, stopped at the end of its turn (the full demo's are right too).
    assert line["prompt"] == "What is 3 plus 4?" and re.fullmatch(
        r"-?\d+ (plus|minus|times) -?\d+ is -?\d+\.", line["answer"]
    )


def test_the_generator_asks_a_hugging_face_directory_in_its_chat_template(model_dir, tmp_path):
    from flax import nnx

    from xlafit.generator import Generator
    from xlafit.hf import llama as llama_hf
    from xlafit.models.generation import generate
    from xlafit.models.llama import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((model_dir / name).read_bytes())
    vocab = clm.load_tokenizer(model_dir).get_vocab_size()
    cfg = LlamaConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=vocab)
    llama_hf.save_hf(LlamaForCausalLM(cfg, rngs=nnx.Rngs(3)), folder)

    ask = Generator.load(str(folder))
    end = ask.tokenizer.token_to_id("<|im_end|>")
    assert ask.template is not None and end in ask.eos_ids
    ids = ask.encode("What is the capital of France?")
    rendered = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert ask.tokenizer.decode(ids, skip_special_tokens=False) == rendered
    tokens = generate(ask.model, [ids], 6, eos_ids=ask.eos_ids)[0]
    assert ask(["What is the capital of France?"], max_new_tokens=6) == [ask.tokenizer.decode(tokens)]
    with pytest.raises(ConfigError, match="neither an llm run"):
        Generator.load(str(model_dir))


def test_parquet_is_read_on_the_calling_thread_only(tmp_path, monkeypatch):
    """Arrow given a Python file reads it from its own I/O threads, which abort the process
    (SIGABRT) when an error ends it mid-read; the bytes are read first, here."""
    import threading

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "content.parquet"
    pq.write_table(pa.table({"content": [f"document {i} " * 40 for i in range(3000)]}), path, row_group_size=200)
    readers: set[str] = set()
    real = chat.filesystem

    class Watched:
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, *args):
            readers.add(threading.current_thread().name)
            return self.f.read(*args)

        def read_at(self, *args):  # what Arrow's PythonFile uses where it can
            readers.add(threading.current_thread().name)
            return self.f.read_at(*args)

    def watched(name):
        fs, p = real(name)
        opened = fs.open

        class FS:
            def open(self, *args, **kw):
                return Watched(opened(*args, **kw))

        return FS(), p

    monkeypatch.setattr(chat, "filesystem", watched)
    assert len(chat.read_records([str(path)])) == 3000
    assert readers == {threading.current_thread().name}


def test_a_parquet_file_without_text_is_one_line_and_exit_2(model_dir, tmp_path):
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "content.parquet"
    pq.write_table(pa.table({"content": [f"document {i} " * 40 for i in range(3000)]}), path, row_group_size=200)
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-m", "xlafit", "train", "llm", "--data-dir", str(path), f"data.tokenizer={model_dir}",
             "--run-dir", str(tmp_path / "run")],
            capture_output=True, text=True, env=USER_ENV,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.count("\n") == 1 and "has no column 'text'" in out.stderr


@pytest.mark.skipif(
    os.environ.get("XLAFIT_STRESS") != "1", reason="about 90 s: XLAFIT_STRESS=1 runs it (the suite's 25-minute budget)"
)
def test_the_error_after_reading_parquet_never_aborts_under_load(model_dir, tmp_path):
    """The test above, 100 times, four at once: Arrow read Python's bytes and one of its
    threads could drop them last while the interpreter exited, aborting about one run in 60
    under load (SIGABRT, "terminate called without an active exception"). Read from Arrow's
    own copy (xlafit.data.shards.parquet_table), none does."""
    import concurrent.futures
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "content.parquet"
    pq.write_table(pa.table({"content": [f"document {i} " * 40 for i in range(3000)]}), path, row_group_size=200)

    def run(i: int) -> int:
        command = [sys.executable, "-m", "xlafit", "train", "llm", "--data-dir", str(path),
                   f"data.tokenizer={model_dir}", "--run-dir", str(tmp_path / f"run-{i}")]  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, env=USER_ENV).returncode

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(run, range(100)))
    assert codes == [2] * 100, {code: codes.count(code) for code in set(codes)}


@pytest.mark.parametrize(
    "record, advice",
    [
        ({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, "model.objective=dpo"),
        ({"prompt": "2+2?", "answer": "4"}, "model.objective=grpo"),
    ],
)
def test_preference_pairs_and_prompts_alone_are_told_which_objective_trains_them(record, advice):
    """Issue 63's second walk: such files given without model.objective were told to set
    data.text_column or data.format, which cannot help."""
    with pytest.raises(DataError, match=advice):
        chat.detect_format([record], "pairs.jsonl")


def test_a_json_lines_file_that_starts_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "bom.jsonl"
    records = b'{"prompt": "2+2?", "completion": "4"}\n{"prompt": "3+3?", "completion": "6"}\n'
    path.write_bytes(b"\xef\xbb\xbf" + records)
    assert chat.read_records([str(path)]) == [
        {"prompt": "2+2?", "completion": "4"},
        {"prompt": "3+3?", "completion": "6"},
    ]


def test_records_whose_answer_the_cut_removes_are_left_out_not_counted_as_zero_rows(model_dir, tmp_path):
    """Issue 63's second walk: a record cut at data.seq_len before its answer kept a row whose
    loss is 0 of 0 tokens, and the mean over rows took it as a zero: the train and eval loss
    and the gradient shrank (2.84 at seq_len 40 against 5.68 at 64 for one model)."""
    tok = clm.load_tokenizer(model_dir)
    template = rendering.template_for(str(model_dir))
    long_question = [CONVERSATION[0], {"role": "user", "content": "Tell me. " * 40}, CONVERSATION[2]]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps({"messages": c}) for c in [CONVERSATION] * 6 + [long_question] * 4))
    train, evaluation = clm.load_packed([str(path)], tok, seq_len=64, eval_fraction=0.3, template=template)
    assert train.source.without_loss == 4 and train.source.unanswered == 0
    assert train.documents + evaluation.documents == 6
    # The twenty-second walk: conversations with no assistant turn were counted with those cut, and
    # told to raise data.seq_len, which keeps none of them.
    unanswered = [CONVERSATION[0], CONVERSATION[1]]
    path.write_text(
        "\n".join(json.dumps({"messages": c}) for c in [CONVERSATION] * 6 + [long_question] * 4 + [unanswered] * 3)
    )
    train, _ = clm.load_packed([str(path)], tok, seq_len=64, eval_fraction=0.3, template=template)
    assert train.source.without_loss == 7 and train.source.unanswered == 3
    cfg = load_config("llm", ["data.seq_len=64"])
    said = llm_data.data_summary(train, _, llm_data.data_config(cfg))
    assert "3 records have no answer (a conversation with no assistant turn): left out" in said
    assert "4 records have no answer token within data.seq_len=64 (cut before their answer): left out" in said
    for packed in (train, evaluation):  # every row has a token the loss counts
        assert (packed.arrays["loss_mask"].sum(axis=1) > 0).all()


def test_a_template_that_prints_content_as_it_is_refuses_a_list_of_parts(model_dir, tmp_path):
    """Issue 63's second walk: with a template that prints `{{ message['content'] }}` (Llama 3.0's,
    Mistral v0.1's style), a list of parts trained as its Python text, exit 0."""
    tok = clm.load_tokenizer(model_dir)
    prints = rendering.ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}")
    assert "user: What" in prints.render(CONVERSATION)  # text content renders as ever
    conversation = [PARTS, CONVERSATION[2]]
    with pytest.raises(DataError, match="prints a message's content as it is.*give each message's content as a string"):
        chat.encode({"messages": conversation}, "chat", tok, prints)


def test_the_loss_is_the_mean_over_answer_tokens_whatever_the_packing(model_dir, tmp_path):
    """The third walk: the llm loss (trained, logged and evaluated) was the mean over packed rows
    of each row's mean, so a row with 4 answer tokens weighed as much as one with 26, and the
    number depended on how records happened to pack. It is the mean over the batch's answer
    tokens, as transformers and TRL compute it; gradient accumulation gives the same."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from xlafit.recipes import llm, load_config
    from xlafit.train.state import TrainState
    from xlafit.train.step import build_eval_step, build_train_step

    short = [CONVERSATION[1], {"role": "assistant", "content": "Hi."}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps({"messages": c}) for c in [CONVERSATION, short] * 4))
    cfg = load_config("llm", [f"data.data_dir={path}", f"data.tokenizer={model_dir}", "data.seq_len=48",
                              "data.eval_fraction=0", "model.preset=custom", "model.num_layers=1",
                              "model.hidden_size=32", "model.num_heads=2", "model.intermediate_size=64"])  # fmt: skip
    train, _ = llm.load_data(cfg)
    rows = {k: jnp.asarray(v[:4]) for k, v in train.arrays.items()}
    model = llm.build_model(cfg, train)
    targets, weights = clm.next_token_targets(rows["input_ids"], rows["segment_ids"], rows.get("loss_mask"))
    tokens = np.asarray(weights.sum(-1))
    assert len(set(tokens.tolist())) > 1  # rows of different answer lengths: the two means differ
    logits = model(rows["input_ids"], rows["segment_ids"], rows["positions"])[:, :-1]
    nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, targets)) * np.asarray(weights)
    token_mean, row_mean = nll.sum() / tokens.sum(), float(np.mean(nll.sum(-1) / tokens))
    assert abs(token_mean - row_mean) > 1e-3

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sums = build_eval_step(graphdef, llm.loss_fn)(TrainState(jnp.int32(0), params, None, rest), rows, jnp.ones(4))
    assert float(sums["loss"] / sums["weight"]) == pytest.approx(token_mean, abs=1e-5)
    tx = optax.sgd(0.0)
    state = TrainState(jnp.int32(0), params, tx.init(params), rest)
    batches = {k: v[None] for k, v in rows.items()}
    for accumulate in (1, 2):
        step = build_train_step(graphdef, llm.loss_fn, tx, unroll=True, accumulate=accumulate)
        _, metrics = step(state, batches)
        assert float(metrics["loss"][0]) == pytest.approx(token_mean, abs=1e-5), accumulate


def test_a_text_or_completion_that_ends_with_the_eos_gets_no_second_one(model_dir):
    """The twenty-second walk: a completion ending in "<|im_end|>" (the eos_token) and a chat
    rendered to text ahead (starting with its BOS) got a second EOS (and BOS): the model was
    taught to end twice. TRL appends the EOS only where the text does not end with it."""
    tok = clm.load_tokenizer(model_dir)
    bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|im_end|>")
    ended = chat.encode({"prompt": "The answer", "completion": " is short.<|im_end|>"}, "prompt_completion", tok, None,
                        bos=bos, eos=eos)  # fmt: skip
    plain = chat.encode({"prompt": "The answer", "completion": " is short."}, "prompt_completion", tok, None,
                        bos=bos, eos=eos)  # fmt: skip
    assert ended.ids == plain.ids and ended.mask == plain.mask and ended.ids.count(eos) == 1
    rendered = chat.encode(
        {"text": "<|begin_of_text|>The answer is short.<|im_end|>"}, "text", tok, None, bos=bos, eos=eos
    )
    assert rendered.ids.count(bos) == 1 and rendered.ids.count(eos) == 1
    assert rendered.ids == chat.encode({"text": "The answer is short."}, "text", tok, None, bos=bos, eos=eos).ids
    (packed,) = clm._with_markers(tok, ["<|begin_of_text|>Paris.<|im_end|>"], bos, eos)
    assert packed.count(bos) == 1 and packed.count(eos) == 1


def test_a_text_file_with_records_of_another_format_is_refused_not_emptied(model_dir, tmp_path):
    """The twenty-second walk: text records, then prompt/completion ones (two datasets in one
    file): the second half was left out as "no text in 'text' (null or empty)"."""
    tok = clm.load_tokenizer(model_dir)
    mixed = tmp_path / "mixed.jsonl"
    records = [{"text": "The answer is short."}] * 3 + [{"prompt": "The answer", "completion": " is short."}]
    mixed.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(
        DataError, match=r"mixed.jsonl, record 4: it has no 'text' \(its keys: prompt, completion\), wh"
    ):
        clm.encode_files([str(mixed)], tok, "auto", "text", None, "assistant", (None, None))


COUNTRY = {"type": "object", "properties": {"country": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "capital", "description": "A capital.", "parameters": COUNTRY}}]
# ChatML with Qwen's tools block: the functions in a system turn of their own.
WITH_TOOLS = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}" + CHATML
)


def test_a_records_tools_reach_the_template_as_trl_passes_them(model_dir):
    """The twenty-second walk: a record's tools column (TRL's tool-calling datasets) was left out,
    and the model trained on calls of functions it was never shown. TRL's SFTTrainer passes it to
    apply_chat_template(tools=...); so does xlafit: the same ids and answer mask."""
    hf = _hf(model_dir, WITH_TOOLS)
    messages = CONVERSATION[1:3]
    expected = hf.apply_chat_template(
        messages, tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    tok = clm.load_tokenizer(model_dir)
    template = rendering.ChatTemplate(WITH_TOOLS, name="the tools template")
    got = chat.encode({"messages": messages, "tools": TOOLS}, "chat", tok, template)
    assert got.ids == list(expected["input_ids"]) and got.mask == list(expected["assistant_masks"])
    assert "# Tools" in tok.decode(got.ids, skip_special_tokens=False)
    kwargs = chat.encode({"messages": messages, "chat_template_kwargs": {"tools": TOOLS}}, "chat", tok, template)
    assert kwargs.ids == got.ids  # TRL's chat_template_kwargs column, read the same way


def test_a_template_without_a_generation_prompt_is_said_to_train_the_turn_header():
    """The twenty-second walk: with a template that renders no generation prompt, each answer's
    `<|im_start|>assistant` header was trained with it, where the guide says it never is."""
    without = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{% endfor %}"
    )
    said = rendering.describe(rendering.ChatTemplate(without, name="my.jinja"))
    assert said.startswith("chat template: my.jinja (warning: it renders no generation prompt, so each answer's")
    assert rendering.describe(rendering.ChatTemplate(CHATML, name="chatml")) == "chat template: chatml"
    generation_prompt = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert rendering.describe(rendering.ChatTemplate(generation_prompt, name="chatml")) == "chat template: chatml"


def test_sharegpt_conversations_train_as_the_same_messages(model_dir):
    """The twenty-second walk: ShareGPT's layout (conversations of {"from", "value"}), which TRL's
    SFTTrainer converts itself, was refused with a fix that could not work."""
    tok, template = clm.load_tokenizer(model_dir), rendering.template_for(str(model_dir))
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {"conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in CONVERSATION]}
    assert chat.detect_format([sharegpt], "sharegpt.jsonl") == "chat"
    got, expected = (chat.encode(r, "chat", tok, template) for r in (sharegpt, {"messages": CONVERSATION}))
    assert got == expected and sum(got.mask) > 0
