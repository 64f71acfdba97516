"""Preference pairs (xlafit.data.preference): TRL's text and conversational layouts, the mask on
the completions only, Parquet, and bad records refused in one line with the fix."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from xlafit.data import chat_demo, clm, rendering
from xlafit.data.preference import load_pairs
from xlafit.errors import DataError


@pytest.fixture(scope="module")
def demo():
    """The chat demo's tokenizer (ChatML with its answers marked), its template and markers."""
    where = chat_demo.demo_files()[2]
    return clm.load_tokenizer(where), rendering.template_for(where, training=True), clm.special_ids(where)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def loaded(tmp_path, demo, records, name="prefs.jsonl", seq_len=64):
    tok, template, markers = demo
    path = write_jsonl(tmp_path / name, records)
    train, _ = load_pairs([path], tok, template, seq_len=seq_len, eval_fraction=0, markers=markers)
    return train, tok


def completion_text(tok, arrays, i, j):
    ids = arrays["input_ids"][i, j][arrays["loss_mask"][i, j] > 0]
    return tok.decode(ids.tolist(), skip_special_tokens=False)


def prompt_ids(arrays, i, j):
    first = int(np.argmax(arrays["loss_mask"][i, j]))
    return arrays["input_ids"][i, j, :first].tolist()


CHOSEN_REJECTED = ("chosen", "rejected")
CONVERSATION = {
    "prompt": [{"role": "user", "content": "What is 2 plus 3?"}],
    "chosen": [{"role": "assistant", "content": "2 plus 3 is 5."}],
    "rejected": [{"role": "assistant", "content": "2 plus 3 is 6."}],
}


def test_conversations_mask_the_answers_and_share_the_prompt(tmp_path, demo):
    train, tok = loaded(tmp_path, demo, [CONVERSATION])
    a = train.arrays
    assert a["input_ids"].shape == (1, 2, 64)
    assert completion_text(tok, a, 0, 0) == "2 plus 3 is 5.<|im_end|>"
    assert completion_text(tok, a, 0, 1) == "2 plus 3 is 6.<|im_end|>"
    assert prompt_ids(a, 0, 0) == prompt_ids(a, 0, 1)
    asked = tok.decode(prompt_ids(a, 0, 0), skip_special_tokens=False)
    assert asked == "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    whole = tok.encode(asked + "2 plus 3 is 5.<|im_end|>\n", add_special_tokens=False).ids  # as chat records
    assert (a["segment_ids"][0] > 0).sum(-1).tolist() == [len(whole)] * 2


def test_an_implicit_prompt_is_the_shared_start(tmp_path, demo):
    implicit = {k: CONVERSATION["prompt"] + CONVERSATION[k] for k in ("chosen", "rejected")}
    explicit, _ = loaded(tmp_path, demo, [CONVERSATION], "explicit.jsonl")
    found, _ = loaded(tmp_path, demo, [implicit], "implicit.jsonl")
    for k in explicit.arrays:
        np.testing.assert_array_equal(found.arrays[k], explicit.arrays[k])


def test_the_prompts_own_assistant_turns_are_not_counted(tmp_path, demo):
    history = [
        {"role": "user", "content": "What is 1 plus 1?"},
        {"role": "assistant", "content": "1 plus 1 is 2."},
        {"role": "user", "content": "And 2 plus 2?"},
    ]
    record = {**CONVERSATION, "prompt": history}
    train, tok = loaded(tmp_path, demo, [record])
    assert completion_text(tok, train.arrays, 0, 0) == "2 plus 3 is 5.<|im_end|>"


def test_text_pairs_count_the_completion_and_its_eos(tmp_path, demo):
    """The prompt after the tokenizer's bos, the completion and its eos counted (as
    prompt/completion records are read)."""
    train, tok = loaded(tmp_path, demo, [{"prompt": "What is 4 plus 4?", "chosen": " 8", "rejected": " 9"}])
    bos, eos = demo[2]
    assert bos is not None and eos is not None
    assert completion_text(tok, train.arrays, 0, 0) == " 8" + tok.id_to_token(eos)
    assert train.source.format == "prompt_completion"
    assert prompt_ids(train.arrays, 0, 0)[0] == bos


def test_parquet_pairs_read_as_json_lines(tmp_path, demo):
    tok, template, _ = demo
    records = chat_demo.preference_pairs(8)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "prefs.parquet")
    from_parquet, _ = load_pairs([str(tmp_path / "prefs.parquet")], tok, template, seq_len=48, eval_fraction=0)
    from_jsonl, _ = loaded(tmp_path, demo, records, seq_len=48)
    for k in from_jsonl.arrays:
        np.testing.assert_array_equal(from_parquet.arrays[k], from_jsonl.arrays[k])


# chosen and rejected as whole conversations, the question first
ASKED_IN_BOTH = {k: [*CONVERSATION["prompt"], *CONVERSATION[k]] for k in CHOSEN_REJECTED}


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "2+2=", "chosen": "4"}, r"record 2 has no 'rejected' .* a preference record needs both"),
        ({"question": "2+2=", "answer": "4"}, r"has no 'chosen' and no 'rejected' \(its keys: question, answer\)"),
        ({"prompt": "2+2=", "chosen": "4", "rejected": "4"}, r"chosen and rejected completions are the same .* remove"),
        ({"chosen": "4", "rejected": "5"}, r'text completions but no "prompt"; give the prompt as its own field'),
        (
            {"prompt": "2+2=", "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"},
            r"mixes kinds of field .* all of them as text, or all as conversations",
        ),
        # The fifteenth walk's: each was refused with another cause and fix, or trained as it should not.
        (
            {**CONVERSATION, "rejected": []},  # was "data.seq_len cuts off entirely ... raise data.seq_len"
            r"record 2: its rejected completion has no assistant turn after the prompt .* an answer each",
        ),
        (
            {"chosen": [*CONVERSATION["prompt"], *CONVERSATION["chosen"]], "rejected": CONVERSATION["prompt"]},
            r"record 2: its rejected completion has no assistant turn after the prompt",
        ),
        (  # UltraFeedback's layout: told to give all as conversations, which asked the question twice
            {"prompt": "What is 2 plus 3?", **ASKED_IN_BOTH},
            r"record 2 has a text prompt and conversations that begin with it .*: leave 'prompt' out \(TRL's implicit",
        ),
        (
            {**CONVERSATION, **ASKED_IN_BOTH},
            r"record 2: chosen and rejected begin with the prompt's last message again, so the model would be asked",
        ),
        (  # no record number before
            {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
            r"prefs.jsonl, record 2 is text, and .*prefs.jsonl, record 1 was a conversation: the preference records",
        ),
    ],
)
def test_bad_records_are_refused_in_one_line_with_the_fix(tmp_path, demo, record, message):
    with pytest.raises(DataError, match=message) as e:
        loaded(tmp_path, demo, [CONVERSATION, record])
    assert "\n" not in str(e.value)
    assert "prefs.jsonl, record 2" in str(e.value)


def test_a_completion_cut_off_entirely_names_seq_len_and_the_record(tmp_path, demo):
    message = r"prefs.jsonl, record 1: .*data.seq_len=8 cuts off entirely .* raise data.seq_len"
    with pytest.raises(DataError, match=message):
        loaded(tmp_path, demo, [CONVERSATION], seq_len=8)


def test_pairs_that_the_cut_makes_alike_are_left_out_and_counted(tmp_path, demo):
    """The fourth walk: a pair whose chosen and rejected rows differ only past data.seq_len
    (`⟦It is ⟧✂7.` against `⟦It is ⟧✂8.`) trained as a pair that prefers nothing: its loss log 2
    whatever the model, and the preference accuracy capped. It is left out, and the summary says so."""
    from xlafit.data.preference import summary

    tok, template, markers = demo
    long_prompt = {**CONVERSATION, "prompt": [{"role": "user", "content": "What is 2 plus 3? " * 6}]}
    rows = loaded(tmp_path, demo, [long_prompt], seq_len=256)[0].arrays["input_ids"][0]
    cut = int(np.argmax(rows[0] != rows[1]))  # the first token that differs ("5" / "6") is past the cut
    path = write_jsonl(tmp_path / "mixed.jsonl", [CONVERSATION, long_prompt, CONVERSATION])
    train, evaluation = load_pairs([path], tok, template, seq_len=cut, eval_fraction=0, markers=markers)
    assert len(train) + len(evaluation) == 2 and train.source.alike == 1
    assert f"1 pairs are left out: within data.seq_len={cut} their chosen and rejected rows are the same" in summary(
        train, evaluation
    )
    with pytest.raises(DataError, match=r"every preference pair is the same .* raise data.seq_len"):
        loaded(tmp_path, demo, [long_prompt], seq_len=cut)


def test_text_pairs_with_a_token_across_the_prompts_end_are_counted_in_the_summary(tmp_path):
    """The fourth walk: with a Mistral tokenizer every text pair's first completion token spans the
    prompt's end (so part of the prompt is compared, as TRL's DPOTrainer does it), and where SFT
    says so in its summary, a preference run said nothing."""
    from helpers import family_tokenizer
    from xlafit.data.preference import summary

    folder = family_tokenizer("mistral", tmp_path / "mistral")
    pairs = [{"prompt": "What is 3 plus 4?", "chosen": " It is 7.", "rejected": " It is 8."}] * 3
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    train, evaluation = load_pairs(
        [path], clm.load_tokenizer(folder), None, seq_len=64, eval_fraction=0, markers=clm.special_ids(folder)
    )
    assert train.source.spans_boundary == 3
    assert "  3 pairs have a token across the prompt's end: each completion starts where" in summary(train, evaluation)


def test_a_held_out_share_that_draws_no_pair_says_there_is_no_evaluation(tmp_path):
    """The eighth walk: `data.eval_fraction=0.02` of 16 pairs drew none, and the start-up said
    only `eval: 0 pairs` (a chat run says why there is no evaluation and what to change)."""
    from helpers import family_tokenizer
    from xlafit.data.preference import summary

    folder = family_tokenizer("mistral", tmp_path / "mistral")
    pairs = [
        {"prompt": f"What is {i} plus 4?", "chosen": f" It is {i + 4}.", "rejected": " It is 0."} for i in range(16)
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    train, evaluation = load_pairs(
        [path], clm.load_tokenizer(folder), None, seq_len=64, eval_fraction=0.02, markers=clm.special_ids(folder)
    )
    assert evaluation.documents == 0
    said = summary(train, evaluation, 0.02)
    assert f"  no evaluation: none of the {train.documents} pairs was drawn for it at data.eval_fraction=0.02" in said
    assert "no evaluation" not in summary(train, evaluation, 0.0)


def test_pairs_with_other_turns_inside_their_completions_say_only_the_answers_are_compared(tmp_path, demo):
    """The fifteenth walk: a pair whose chosen and rejected hold a user's reply between two
    answers compares their assistant turns alone, where TRL's DPOTrainer compares every token
    after the prompt; nothing said so."""
    from xlafit.data.preference import summary

    thanks = [{"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You are welcome."}]
    record = {**CONVERSATION, **{k: [*CONVERSATION[k], *thanks] for k in CHOSEN_REJECTED}}
    train, tok = loaded(tmp_path, demo, [CONVERSATION, record, record], seq_len=96)
    assert "Thanks!" not in completion_text(tok, train.arrays, 1, 0) and "welcome" in completion_text(
        tok, train.arrays, 1, 0
    )
    assert (train.source.other_turns, train.source.first_other_turns) == (2, f"{tmp_path / 'prefs.jsonl'}, record 2")
    assert (
        f"  2 pairs hold another role's turns inside chosen or rejected (the first: {tmp_path / 'prefs.jsonl'}, "
        "record 2): only their assistant turns are compared (TRL's DPOTrainer" in summary(train, train)
    )
