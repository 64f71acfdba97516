"""`xlafit data show` (xlafit.data.show): the text it marks as trained is the text of the
tokens the llm recipe's loss counts, for chat, prompt/completion and text data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import family_tokenizer
from xlafit.data import clm
from xlafit.data.show import CLOSE, OPEN
from xlafit.recipes import llm_data, load_config

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 3 plus 4?"},
    {"role": "assistant", "content": "It is 7."},
    {"role": "user", "content": "Say hi to the model."},
    {"role": "assistant", "content": "Hi, and how are you today?"},
]
CASES = {  # the data, the tokenizer family, extra arguments
    "chat": ({"messages": CONVERSATION}, "gemma3", []),
    "chat-all": ({"messages": CONVERSATION}, "qwen3", ["--loss-on", "all"]),
    "prompt_completion": ({"prompt": "Say hi.", "completion": " Hi, and how are you today?"}, "mistral", []),
    "text": ({"text": "The capital of France is Paris. What is 3 plus 4? It is 7."}, "xlafit", []),
}  # fmt: skip


def _trained_runs(folder, data, extra):
    """The recipe's first packed sequence: its token count, and the text of each run of the
    tokens its loss counts (next_token_targets' weights on the packed rows)."""
    loss_on = extra[1] if extra else "assistant"
    cfg = load_config("llm", [f"data.data_dir={data}", f"data.tokenizer={folder}", "data.seq_len=128",
                              "data.eval_fraction=0", f"data.loss_on={loss_on}"])  # fmt: skip
    train, _ = llm_data.load_data(cfg)
    a = train.arrays
    _, weights = clm.next_token_targets(a["input_ids"], a["segment_ids"], a.get("loss_mask"))
    first = a["segment_ids"][0] == 1
    ids = a["input_ids"][0][first].tolist()
    trained = [False] + (weights[0][: len(ids) - 1] > 0).tolist()
    tok = clm.load_tokenizer(folder)
    spans, run = [], []
    for i, t in zip(ids, trained, strict=True):
        if t:
            run.append(i)
        elif run:
            spans.append(tok.decode(run, skip_special_tokens=False))
            run = []
    if run:
        spans.append(tok.decode(run, skip_special_tokens=False))
    return len(ids), sum(trained), spans, tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_marked_text_is_what_the_recipes_loss_trains_on(case, tmp_path):
    record, family, extra = CASES[case]
    folder = family_tokenizer(family, tmp_path / family)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(record) for _ in range(4)) + "\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-m", "xlafit", "data", "show", str(data), "--tokenizer", str(folder), "-n", "2",
         "--seq-len", "128", *extra],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    blocks = re.split(r"\n--- record \d+: ", out.stdout)
    assert len(blocks) == 3  # the header and -n 2 records
    tokens, trained, spans, text = _trained_runs(folder, data, extra)
    assert 0 < trained < tokens
    head, body = blocks[1].split("\n", 1)
    assert head == f"{tokens} tokens, {trained} trained"
    shown = re.findall(f"{OPEN}(.*?){CLOSE}", body, flags=re.S)
    assert [s.strip() for s in shown] == [s.strip() for s in spans]  # a run decoded alone may lose a leading space
    assert body.replace(OPEN, "").replace(CLOSE, "").rstrip("\n") == text.rstrip("\n")  # the whole text, in order
    assert blocks[1].rstrip("\n") == blocks[2].rstrip("\n")


def test_show_names_the_chat_template_and_refuses_an_empty_file(tmp_path, capsys):
    """Issue 63's walk: `data show` rendered Qwen3 conversations with xlafit's training
    template in place of the tokenizer's official one without a word (a run says it in a
    line), and an empty file printed its header and nothing, exit 0. It says which template,
    as the run does; an empty file is refused as training refuses it."""
    from pathlib import Path

    from xlafit.cli import main

    folder = family_tokenizer("qwen3", tmp_path / "qwen3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (Path(__file__).parent / "chat_templates" / "qwen3.jinja").read_text()  # the official
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    capsys.readouterr()
    assert main(["data", "show", str(data), "--tokenizer", str(folder), "-n", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(
        "  chat template: xlafit's training template for Qwen3 (data.chat_template=qwen3), in place of the chat "
        f"template of {folder}/tokenizer_config.json"
    ), lines[:3]
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["data", "show", str(tmp_path / "empty.jsonl"), "--tokenizer", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"xlafit: error: {tmp_path / 'empty.jsonl'} holds no documents or records")


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_preference_pairs_show_each_completion_after_its_prompt_as_the_objective_compares_it(family, tmp_path, capsys):
    """Issue 63's second walk: `data show` could not show preference pairs. Text pairs
    (Mistral's tokenizer) and conversation pairs (Qwen3's template): each completion is marked,
    with as many tokens as the preference loss sums for it."""
    from xlafit.cli import main
    from xlafit.data import clm, preference
    from xlafit.data.clm import next_token_targets
    from xlafit.data.rendering import template_for

    folder = family_tokenizer(family, tmp_path / family)
    if family == "mistral":
        record = {"prompt": "What is 3 plus 4?", "chosen": " It is 7.", "rejected": " It is 8."}
    else:
        record = {
            "prompt": [{"role": "user", "content": "What is 3 plus 4?"}],
            "chosen": [{"role": "assistant", "content": "It is 7."}],
            "rejected": [{"role": "assistant", "content": "It is 8."}],
        }
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(record) + "\n")
    capsys.readouterr()
    assert main(["data", "show", str(data), "--tokenizer", str(folder), "-n", "1", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "preference pairs (train them with model.objective=dpo" in out
    records = out.split("\n--- ")[1:]  # the header line names the marks too
    marked = [re.findall(f"{re.escape(OPEN)}(.*?){re.escape(CLOSE)}", r, re.S) for r in records]
    assert [len(m) for m in marked] == [1, 1] and "7." in marked[0][0] and "8." in marked[1][0], out
    counts = [int(n) for n in re.findall(r"tokens, (\d+) compared", out)]
    train, _ = preference.load_pairs(
        [str(data)], clm.load_tokenizer(folder), template_for(str(folder), training=True), seq_len=256,
        eval_fraction=0.0, markers=clm.special_ids(folder),
    )  # fmt: skip
    rows = {k: v.reshape(-1, v.shape[-1]) for k, v in train.arrays.items()}
    _, weights = next_token_targets(rows["input_ids"], rows["segment_ids"], rows["loss_mask"])
    assert counts == [int(w) for w in weights.sum(axis=1)]


def test_grpo_prompts_are_shown_as_the_rollout_gives_them_to_the_model(tmp_path, capsys):
    """The fifth walk: `data show` refused a GRPO prompt file ("prompts train with rewards"), the
    one tool that shows how a record is rendered. Each prompt is shown with as many tokens as
    GRPO's loader encodes for it, and the columns the rewards get."""
    from xlafit.cli import main
    from xlafit.data.prompts import load_prompts
    from xlafit.data.rendering import template_for

    folder = family_tokenizer("qwen3", tmp_path / "qwen3")
    records = [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in (("What is 3 plus 4?", "7"),
               ("What is 12 plus 30, and why?", "42"))]  # fmt: skip
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    capsys.readouterr()
    assert main(["data", "show", str(data), "--tokenizer", str(folder), "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "prompts (train them with model.objective=grpo and reward functions)" in out
    assert "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n" in out
    counts = [
        int(n) for n in re.findall(r"--- record \d+: (\d+) prompt tokens \(\w+\); columns for the rewards: answer", out)
    ]
    loaded = load_prompts([str(data)], clm.load_tokenizer(folder), template_for(str(folder)), (), group=1,
                          bos=clm.special_ids(folder)[0])  # fmt: skip
    assert counts == [len(ids) for ids in loaded.ids]


def test_a_text_file_is_shown_not_read_as_records(tmp_path, capsys):
    """The check for preference pairs reads record files only: a text file is documents."""
    from xlafit.cli import main

    folder = family_tokenizer("xlafit", tmp_path / "tok")
    data = tmp_path / "doc.txt"
    data.write_text("The capital of France is Paris.\n\nWhat is 3 plus 4? It is 7.\n")
    capsys.readouterr()
    assert main(["data", "show", str(data), "--tokenizer", str(folder), "-n", "1", "--color", "never"]) == 0
    assert "text documents" in capsys.readouterr().out


def test_the_place_where_seq_len_cuts_a_record_is_marked(tmp_path, capsys):
    """Issue 63's walk: a record longer than --seq-len was shown whole, its cut named in the
    header only. The mark stands after the record's first --seq-len tokens, and nothing after it
    is trained."""
    from xlafit.cli import main
    from xlafit.data.show import CUT

    folder = family_tokenizer("qwen3", tmp_path / "qwen3")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    tok = clm.load_tokenizer(folder)
    capsys.readouterr()
    assert main(["data", "show", str(data), "--tokenizer", str(folder), "-n", "1", "--seq-len", "48"]) == 0
    head, body = capsys.readouterr().out.split("\n--- record 1: ")[1].split("\n", 1)
    assert head.endswith(f", cut at --seq-len 48 (at {CUT})") and body.count(CUT) == 1
    kept, dropped = body.replace(OPEN, "").replace(CLOSE, "").split(CUT)
    assert len(tok.encode(kept, add_special_tokens=False).ids) == 48  # the row's tokens, and no more
    assert OPEN in body.split(CUT)[0] and OPEN not in body.split(CUT)[1]  # what the cut removes trains nothing
    assert main(["data", "show", str(data), "--tokenizer", str(folder), "-n", "1", "--seq-len", "256"]) == 0
    assert CUT not in capsys.readouterr().out  # a whole record carries no mark
    assert main(["data", "show", str(data), "--tokenizer", str(folder), "-n", "1", "--seq-len", "12"]) == 0
    assert "no answer token is left, and training leaves the record out" in capsys.readouterr().out
    # A conversation with no assistant turn trains nothing either (training refuses a file of them).
    data.write_text(json.dumps({"messages": CONVERSATION[:1]}) + "\n")
    assert main(["data", "show", str(data), "--tokenizer", str(folder), "-n", "1"]) == 0
    assert "0 trained; no token of it counts for the loss (no answer), and training leaves the record out" in (
        capsys.readouterr().out
    )


def test_show_names_its_own_flags_in_its_errors(tmp_path, capsys):
    """The sixth walk: `data show` of a Parquet file without a text column said "set
    data.text_column", a key; its flag is --text-column."""
    from xlafit.cli import main

    folder = family_tokenizer("qwen3", tmp_path / "qwen3")
    data = tmp_path / "body.jsonl"
    data.write_text(json.dumps({"body": "What is 3 plus 4?", "id": 1}) + "\n")
    assert main(["data", "show", str(data), "--tokenizer", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "set --text-column to the one holding the text, or --format" in err and "data.text_column" not in err


def test_a_template_given_by_flag_is_named_by_that_flag(tmp_path, capsys):
    """The seventh walk: `data show --chat-template FILE` said `(data.chat_template)`, the
    config's key, in a command whose flag is --chat-template."""
    from xlafit.cli import main

    folder = family_tokenizer("qwen3", tmp_path / "qwen3")
    template = tmp_path / "my_template.jinja"
    template.write_text(
        "{% for m in messages %}### {{ m.role }}:\n{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}### assistant:\n{% endif %}"
    )
    data = tmp_path / "chat.jsonl"
    turn = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "7."}]
    data.write_text(json.dumps({"messages": turn}) + "\n")
    capsys.readouterr()
    assert main(["data", "show", str(data), "--tokenizer", str(folder), "--chat-template", str(template)]) == 0
    out = capsys.readouterr().out
    assert f"chat template: the chat template in {template} (--chat-template)" in out, out
    assert "data.chat_template" not in out, out


def test_a_pair_or_prompt_file_that_training_refuses_is_refused_by_data_show_too(tmp_path, capsys):
    """The fifteenth walk: `data show` exited 0 on a preference file mixing text and
    conversation records and on a pair whose rejected conversation was empty (`0 compared`),
    which training refuses."""
    from xlafit.cli import main

    folder = family_tokenizer("qwen3", tmp_path / "qwen3")
    asked = [{"role": "user", "content": "What is 3 plus 4?"}]
    pair = {"prompt": asked, "chosen": [{"role": "assistant", "content": "It is 7."}],
            "rejected": [{"role": "assistant", "content": "It is 8."}]}  # fmt: skip
    cases = {
        "mixed.jsonl": ([pair, {"prompt": "3+4=", "chosen": "7", "rejected": "8"}], "record 2 is text, and"),
        "empty.jsonl": ([pair, {**pair, "rejected": []}], "record 2: its rejected completion has no assistant turn"),
        "prompts.jsonl": ([{"prompt": asked}, {"prompt": "3+4="}], "record 2 is text, and"),
    }
    for name, (records, message) in cases.items():
        data = tmp_path / name
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        capsys.readouterr()
        assert main(["data", "show", str(data), "--tokenizer", str(folder), "--color", "never"]) == 2, name
        assert f"{data}, {message}" in capsys.readouterr().err, name


def test_what_data_show_printed_comes_before_its_error_in_a_file(tmp_path):
    """The fifteenth walk: with stdout and stderr into one file, `data show`'s error came before
    the lines it had printed (stdout buffered, stderr not), which read as if it succeeded."""
    folder = family_tokenizer("qwen3", tmp_path / "qwen3")
    pair = {"prompt": "3+4=", "chosen": "7", "rejected": "8"}
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(pair) + "\n" + json.dumps({**pair, "rejected": "7"}) + "\n")
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a user's stdout into a file
    out = subprocess.run(
        [sys.executable, "-m", "xlafit", "data", "show", str(data), "--tokenizer", str(folder)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False, env=buffered,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stdout.index("preference pairs (train them") < out.stdout.index("xlafit: error:"), out.stdout


def test_show_cuts_where_a_run_cuts_by_default(tmp_path, capsys):
    """The twenty-second walk: `data show` cut at 256 tokens by default, the llm recipe at 128,
    so the preview showed whole the records a run cuts. Its default is the recipe's, named."""
    from xlafit.cli import main

    folder = family_tokenizer("xlafit", tmp_path / "tok")
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "Say hi. " * 20, "completion": " Hi, and how are you today?" * 6}) + "\n")
    recipe = load_config("llm", []).data.seq_len
    capsys.readouterr()
    assert main(["data", "show", str(data), "--tokenizer", str(folder), "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert f"cut at --seq-len {recipe};" in out.splitlines()[0]
    assert f", cut at --seq-len {recipe} (at " in out  # the record is longer than a run's rows


def test_a_folder_of_splits_shows_its_train_split(tmp_path, capsys):
    """A folder of train-, validation- and test- files showed the first file in name order,
    a test record, as what a run trains on. It shows the train split, and says which split
    evaluates (the rest is not read)."""
    from xlafit.cli import main

    folder = family_tokenizer("xlafit", tmp_path / "tok")
    data = tmp_path / "data"
    data.mkdir()
    for split in ("test", "train", "validation"):
        record = {"prompt": f"A {split} question?", "completion": f" A {split} answer."}
        (data / f"{split}-00000.jsonl").write_text(json.dumps(record) + "\n")
    capsys.readouterr()
    assert main(["data", "show", str(data), "--tokenizer", str(folder), "-n", "3", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "A train answer" in out and "test answer" not in out and "validation answer" not in out, out
    assert "eval: the validation split" in out and "its test split is not read" in out, out


def test_prepared_images_are_shown_with_their_classes_counted_from_the_folder(tmp_path, capsys):
    """`data show DIR` of what `xlafit data images` wrote: each split's images by class (counted
    here from the user's folder), the classes a split lacks, the file left out and why, and the
    first training images as the folder holds them (size and mode read here with Pillow)."""
    from PIL import Image

    from xlafit.cli import main
    from xlafit.data.images import prepare

    folder = tmp_path / "photos"
    counts = {"train": {"ant": 5, "bee": 2, "wasp": 3}, "val": {"ant": 1, "bee": 2}}
    rng = np.random.default_rng(0)
    for split, classes in counts.items():
        for name, n in classes.items():
            (folder / split / name).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (12 + i, 9, 3), dtype=np.uint8)).save(
                    folder / split / name / f"{i}.png"
                )
    (folder / "val" / "wasp").mkdir()  # the split folders must name the same classes
    Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).convert("L").save(
        folder / "train" / "ant" / "grey.jpg"
    )
    (folder / "train" / "bee" / "cut.png").write_bytes(b"\x89PNG not an image")
    prepare(folder, str(tmp_path / "prepared"), shard_size=4, workers=1)
    capsys.readouterr()

    assert main(["data", "show", str(tmp_path / "prepared"), "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "3 classes (labels 0-2 in this order), 3 channels" in out
    assert (
        "train: 11 images in 3 shards; by class: ant 6, bee 2, wasp 3; 1 left out, not decodable: train/bee/cut.png"
        in out
    )
    assert "eval: 3 images in 1 shard; by class: ant 1, bee 2; none of wasp" in out
    shown = re.findall(r"  \d\. (\S+): label (\d) \((\w+)\), (\d+)x(\d+) (\w+) (\w+), ([\d,]+) bytes", out)
    assert len(shown) == 2
    for file, label, name, width, height, mode, kind, size in shown:
        with Image.open(folder / file) as image:
            assert (int(width), int(height), mode, kind) == (image.width, image.height, image.mode, image.format)
        assert file.split("/")[1] == name == ["ant", "bee", "wasp"][int(label)]
        assert int(size.replace(",", "")) == (folder / file).stat().st_size


def test_prepared_mlm_data_in_a_bucket_is_shown_as_the_run_reads_it(korean_tokenizer, capsys):
    """`data show URL` of what `xlafit data mlm` wrote (here in fsspec's memory store): the
    counts of the manifest, the padding share of the sequences a run reads, and the first
    sequences decoded with the data's own tokenizer; records without --tokenizer say what to give."""
    from xlafit.cli import main
    from xlafit.data import mlm
    from xlafit.data.text import korean_demo_files
    from xlafit.data.tokenizer import load_tokenizer

    url = "memory://show-mlm"
    manifest = mlm.prepare(korean_tokenizer, korean_demo_files(), url, seq_len=48, packing="pairs", show_progress=False)
    arrays, _ = mlm.load_split(url, "train")
    capsys.readouterr()
    assert main(["data", "show", url, "-n", "2"]) == 0
    out = capsys.readouterr().out
    train = manifest["splits"]["train"]
    padding = 1 - arrays["length"].sum() / arrays["input_ids"].size
    assert f"train: {train['documents']:,} documents -> {train['sequences']:,} sequences" in out
    assert f"({padding:.1%} padding)" in out and "packed as pairs into 48 tokens" in out
    tok = load_tokenizer(korean_tokenizer)
    for row in range(2):
        n = int(arrays["length"][row])
        second = int(np.flatnonzero(arrays["token_type_ids"][row][:n])[0])
        assert f"--- sequence {row + 1}: {n} of 48 tokens, the second segment from token {second}\n" in out
        text = tok.decode(arrays["input_ids"][row][:n].tolist(), skip_special_tokens=False)
        assert f"\n{text}\n" in out and text.startswith("[CLS]")

    records = korean_tokenizer / "records.jsonl"
    records.write_text(json.dumps({"text": "안녕하세요"}) + "\n")
    capsys.readouterr()
    assert main(["data", "show", str(records)]) == 2
    assert re.search(r"records\.jsonl: records are shown .* give --tokenizer T", capsys.readouterr().err)
