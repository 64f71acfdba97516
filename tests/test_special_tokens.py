"""A tokenizer's document markers (xlafit.data.special_tokens) are read from its own files:
for the tokenizers of Gemma 3, Llama 3, Qwen3, Mistral and xlafit's own, training puts before
each document and prompt/completion record the token transformers' tokenizer puts there, and
after it the eos_token TRL appends; `generate` without the template sends the ids
transformers' tokenizer gives a prompt; a run and its export keep them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from helpers import TOKENIZER_FAMILIES, family_tokenizer
from xlafit.data import clm
from xlafit.errors import ConfigError, DataError
from xlafit.recipes import llm_data, load_config

transformers = pytest.importorskip("transformers")

TEXT = "What is 3 plus 4? It is 7."
PROMPT, COMPLETION = "Say hi to the model.", " Hi, and how are you today?"


@pytest.fixture(scope="module", params=TOKENIZER_FAMILIES)
def family(request, tmp_path_factory):
    """``(name, folder, transformers' tokenizer of it)``."""
    folder = family_tokenizer(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, folder, transformers.AutoTokenizer.from_pretrained(str(folder))


def _segments(packed):
    """Each packed sequence's ids and loss mask, in row order."""
    ids, seg = packed.arrays["input_ids"], packed.arrays["segment_ids"]
    mask = packed.arrays.get("loss_mask", np.ones_like(ids))
    return [(ids[r][seg[r] == s].tolist(), mask[r][seg[r] == s].tolist()) for r in range(len(ids)) for s in
            range(1, int(seg[r].max()) + 1)]  # fmt: skip


def _train(folder, data, tmp_path):
    cfg = load_config(
        "llm", [f"data.data_dir={data}", f"data.tokenizer={folder}", "data.seq_len=128", "data.eval_fraction=0"]
    )
    train, _ = llm_data.load_data(cfg)
    return cfg, train


def test_documents_and_completions_get_the_markers_transformers_and_trl_give(family, tmp_path):
    """Text: transformers' ids of the text, then eos_token (TRL appends it); prompt/completion:
    the prompt's ids as transformers gives them, the completion's, eos_token; read by the
    recipe from the tokenizer's folder (Gemma's <bos>/<eos> were unknown by name)."""
    name, folder, hf = family
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": TEXT}) for _ in range(3)))
    _, train = _train(folder, text, tmp_path)
    assert hf.eos_token_id is not None
    expected = hf(TEXT)["input_ids"] + [hf.eos_token_id]
    assert [ids for ids, _ in _segments(train)] == [expected] * 3
    pc = tmp_path / "pc.jsonl"
    pc.write_text("\n".join(json.dumps({"prompt": PROMPT, "completion": COMPLETION}) for _ in range(3)))
    _, train = _train(folder, pc, tmp_path)
    # TRL's SFTTrainer: the prompt and completion encoded as one text, the answer from where the
    # prompt's own ids end (Mistral's tokenizer once got a second "▁" before a completion encoded alone)
    # (from where the two diverge: a token can span the boundary, as in this tiny Gemma tokenizer).
    prompt, whole = hf(PROMPT)["input_ids"], hf(PROMPT + COMPLETION)["input_ids"]
    # TRL's common_prefix_length:
    shared = next((i for i, (a, b) in enumerate(zip(prompt, whole, strict=False)) if a != b), len(prompt))
    answer = whole[shared:] + [hf.eos_token_id]
    assert _segments(train) == [(whole[:shared] + answer, [0] * shared + [1] * len(answer))] * 3
    assert train.source.spans_boundary == (3 if shared < len(prompt) else 0)  # the summary says so
    full, bare = hf(TEXT)["input_ids"], hf(TEXT, add_special_tokens=False)["input_ids"]
    head = full[: len(full) - len(bare)]
    assert clm.special_ids(folder) == (head[0] if head else None, hf.eos_token_id)
    assert len(head) == (name != "qwen3")  # Qwen puts nothing before a text


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny Llama's weights (config.json + safetensors), for a tokenizer to go beside."""
    torch = pytest.importorskip("torch")
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def test_generate_without_the_template_sends_what_transformers_tokenizer_gives(family, tiny_llama, tmp_path):
    from xlafit.generator import Generator

    _, folder, hf = family
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    for f in folder.glob("*.json"):
        shutil.copy(f, model / f.name)
    ask = Generator.load(str(model))
    assert ask.encode(TEXT, use_chat=False) == hf(TEXT)["input_ids"]


def test_a_run_and_its_export_keep_the_markers_it_trained_with(family, tmp_path):
    """The run's tokenizer/ reads as the tokenizer did; its export encodes in transformers as
    the source tokenizer does (<bos> first where it was) and names the same eos_token."""
    from xlafit.export import _write_tokenizer
    from xlafit.io.paths import as_path

    _, folder, hf = family
    pc = tmp_path / "pc.jsonl"
    pc.write_text("\n".join(json.dumps({"prompt": PROMPT, "completion": COMPLETION}) for _ in range(3)))
    cfg, train = _train(folder, pc, tmp_path)
    run = tmp_path / "run"
    llm_data.save_artifacts(cfg, as_path(str(run)), train)
    assert clm.special_ids(run / "tokenizer") == clm.special_ids(folder)
    tokens = json.loads((run / "tokenizer" / "tokenizer_config.json").read_text())
    out = tmp_path / "export"
    out.mkdir()
    _write_tokenizer(cfg, (run / "tokenizer" / "tokenizer.json").read_text(), out, None, tokens)
    exported = transformers.AutoTokenizer.from_pretrained(str(out))
    assert exported(TEXT)["input_ids"] == hf(TEXT)["input_ids"]
    assert exported.eos_token_id == hf.eos_token_id


def test_a_tokenizer_json_of_an_older_xlafit_alone_is_read_as_it_trained(tmp_path):
    """Its <s>, </s>, <pad> at ids 0, 1, 2 and no files beside it: <s> first, </s> last, as it
    trained; its run's export puts <s> first in transformers too."""
    from xlafit.export import _write_tokenizer

    folder = family_tokenizer("xlafit", tmp_path / "tok")
    (folder / "tokenizer_config.json").unlink()
    spec = json.loads((folder / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps({**spec, "post_processor": None}))
    assert clm.special_ids(folder) == (0, 1)
    out = tmp_path / "export"
    out.mkdir()
    cfg = load_config("llm", [f"data.tokenizer={folder}"])
    _write_tokenizer(cfg, (folder / "tokenizer.json").read_text(), out, None, {})
    exported = transformers.AutoTokenizer.from_pretrained(str(out))
    assert exported(TEXT)["input_ids"][0] == 0 and exported.eos_token_id == 1


def test_conversations_without_an_assistant_turn_are_named_as_such(tmp_path):
    """System-only conversations: Gemma's template renders them as <bos> alone (nothing to
    train on), ChatML's as turns with no answer (nothing the loss counts); either way the
    error says they have no assistant turn, not that the file is not JSON-lines records."""
    system = [{"role": "system", "content": "You answer briefly."}]
    data = tmp_path / "system.jsonl"
    data.write_text("\n".join(json.dumps({"messages": system}) for _ in range(4)))
    for family, fix in (("gemma3", "give conversations with an assistant turn"), ("qwen3", "data.loss_on=all")):
        folder = family_tokenizer(family, tmp_path / family)
        with pytest.raises(DataError, match=rf"4 of its 4 conversations have no assistant turn.*{fix}"):
            _train(folder, data, tmp_path)


def test_a_loaded_tokenizer_given_to_special_ids_is_told_to_give_its_folder(family):
    """Issue 63's second walk: the issue's own command, special_ids(load_tokenizer(folder)), was a
    TypeError from deep in the path code."""
    _, folder, _ = family
    with pytest.raises(ConfigError, match=r"special_ids\('path/to/model'\)"):
        clm.special_ids(clm.load_tokenizer(folder))
