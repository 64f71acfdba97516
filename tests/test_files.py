"""What a data path is read as: file types by extension, and the splits of a folder named as
the ``datasets`` library names them (the twenty-second walk: S2, S8, C2)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from xlafit.data import clm, files
from xlafit.data.chat import read_records
from xlafit.data.text import read_lines
from xlafit.errors import DataError

PAIRS = [{"prompt": f"What is {i} plus {i}?", "completion": f" It is {2 * i}."} for i in range(12)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(p["prompt"] + p["completion"] for p in PAIRS) * 5)
    return clm.train_bpe([corpus], vocab_size=300, out=root)


def _jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize(
    "name, fix",
    [
        ("pc.csv", "convert it to JSON lines or Parquet"),
        ("pc.tsv", "convert it to JSON lines or Parquet"),
        ("pc.jsonl.gz", "decompress it first"),
        ("data-00000-of-00001.arrow", "write the dataset with to_parquet or to_json"),
        ("notes.log", "give text as .txt"),
    ],
)
def test_a_file_type_not_read_is_refused_with_the_fix_not_trained_as_text(tok, tmp_path, name, fix):
    path = tmp_path / name
    path.write_bytes(b'prompt,completion\n"What is 1 plus 1?"," It is 2."\n')
    with pytest.raises(DataError, match=f"{name}: not a file type xlafit reads .*{fix}"):
        clm.load_packed([str(path)], tok, seq_len=32, eval_fraction=0)
    if name.endswith(".log"):  # a folder's other files (a README.md) are no data: not named
        return
    # a folder of them says the same, not "no input file matches"
    with pytest.raises(DataError, match=f"{name}: not a file type xlafit reads"):
        clm.data_files([str(tmp_path)])


def test_ndjson_and_a_json_array_are_records_and_a_folder_lists_them(tok, tmp_path):
    (tmp_path / "a.ndjson").write_text("".join(json.dumps(r) + "\n" for r in PAIRS[:6]))
    (tmp_path / "b.json").write_text(json.dumps(PAIRS[6:], indent=2))  # datasets' to_json(lines=False)
    (tmp_path / "dataset_info.json").write_text("{}")  # datasets' metadata: not records
    assert [f.rsplit("/", 1)[-1] for f in clm.data_files([str(tmp_path)])] == ["a.ndjson", "b.json"]
    train, evaluation = clm.load_packed([str(tmp_path)], tok, seq_len=32, eval_fraction=0)
    assert train.source.format == "prompt_completion" and train.documents == 12


def test_a_hugging_face_split_folder_trains_on_train_and_evaluates_on_test(tok, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.Table.from_pylist(PAIRS[:9]), data / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(PAIRS[9:]), data / "test-00000-of-00001.parquet")
    train, evaluation = clm.load_packed([str(data)], tok, seq_len=32, eval_fraction=0.5)
    assert (train.documents, evaluation.documents) == (9, 3)  # not a random half of the union
    assert train.source.eval_from.startswith("eval: the test split of")
    assert "in place of data.eval_fraction" in train.source.eval_from
    # validation wins over test, and says the test split is not read
    _jsonl(data / "validation.jsonl", PAIRS[:2])
    train, evaluation = clm.load_packed([str(data)], tok, seq_len=32)
    assert (train.documents, evaluation.documents) == (9, 2) and "test split is not read" in train.source.eval_from
    # files named one by one are read as given
    train, evaluation = clm.load_packed([str(data / "*.parquet")], tok, seq_len=32, eval_fraction=0)
    assert train.documents == 12 and not train.source.eval_from


def test_evaluation_files_can_be_named_and_not_be_trained_on(tok, tmp_path):
    a, b = _jsonl(tmp_path / "a.jsonl", PAIRS[:8]), _jsonl(tmp_path / "b.jsonl", PAIRS[8:])
    train, evaluation = clm.load_packed([a], tok, seq_len=32, eval_inputs=[b])
    assert (train.documents, evaluation.documents) == (8, 4)
    assert train.source.eval_from.startswith("eval: data.eval_data_dir")
    with pytest.raises(DataError, match="a.jsonl is both trained and evaluated on"):
        clm.load_packed([str(tmp_path)], tok, seq_len=32, eval_inputs=[a])


def test_a_split_folder_with_a_file_of_no_split_or_no_train_split_is_refused(tok, tmp_path):
    _jsonl(tmp_path / "test.jsonl", PAIRS[:3])
    _jsonl(tmp_path / "extra.jsonl", PAIRS[3:])
    with pytest.raises(DataError, match="extra.jsonl is named for no split"):
        clm.load_packed([str(tmp_path)], tok, seq_len=32)
    (tmp_path / "extra.jsonl").unlink()
    with pytest.raises(DataError, match="none is named for the train split"):
        clm.load_packed([str(tmp_path)], tok, seq_len=32)


def test_split_names_are_read_as_datasets_reads_them():
    names = ["train-00000-of-00002.parquet", "my_train.jsonl", "dev.jsonl", "val.json", "test_0.parquet", "eval.txt"]
    assert [files.split_of(n) for n in names] == ["train", "train", "validation", "validation", "test", "test"]
    assert [files.split_of(n) for n in ["trainer.txt", "contest.jsonl", "devices.json"]] == [None, None, None]


def test_text_that_is_not_utf8_names_its_line(tmp_path):
    text = tmp_path / "latin1.txt"
    text.write_bytes(b"hello\n" * 3000 + "caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt:3001 \(byte 18003\) is not UTF-8 text"):
        list(read_lines([str(text)]))
    records = tmp_path / "latin1.jsonl"
    records.write_bytes(b'{"text": "a"}\n' + json.dumps({"text": "caf\xe9"}, ensure_ascii=False).encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jsonl:2 is not UTF-8 text"):
        read_records([str(records)])


def test_the_run_takes_data_eval_data_dir_and_says_where_its_evaluation_comes_from(tok, tmp_path, capsys):
    from xlafit.recipes import llm_data, load_config

    tok.save(str(tmp_path / "tokenizer.json"))
    train_file, eval_file = _jsonl(tmp_path / "d" / "a.jsonl", PAIRS[:8]), _jsonl(tmp_path / "e.jsonl", PAIRS[8:])
    overrides = [f"data.data_dir={train_file}", f"data.tokenizer={tmp_path}", "data.seq_len=32"]
    cfg = load_config("llm", [*overrides, f"data.eval_data_dir={eval_file}"])
    train, evaluation = llm_data.load_data(cfg)
    assert (train.documents, evaluation.documents) == (8, 4)
    assert f"eval: data.eval_data_dir ({eval_file}), in place of data.eval_fraction" in capsys.readouterr().err


def test_preference_pairs_of_a_split_folder_evaluate_on_its_test_split(tok, tmp_path):
    from xlafit.data.preference import load_pairs

    pairs = [{"prompt": p["prompt"], "chosen": p["completion"], "rejected": " It is -1."} for p in PAIRS]
    _jsonl(tmp_path / "train.jsonl", pairs[:9])
    _jsonl(tmp_path / "test.jsonl", pairs[9:])
    said = []
    train, evaluation = load_pairs([str(tmp_path)], tok, None, seq_len=32, eval_fraction=0.5, progress=said.append)
    assert (train.documents, evaluation.documents) == (9, 3)
    assert any(line.startswith("eval: the test split of") for line in said)


def test_a_file_of_a_type_not_read_beside_the_data_is_said_to_be_left_out(tmp_path, caplog):
    """A CSV beside JSON-lines files in a folder was left out without a word."""
    import logging

    _jsonl(tmp_path / "a.jsonl", PAIRS)
    (tmp_path / "more.csv").write_text("prompt,completion\n")
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        assert [f.rsplit("/", 1)[-1] for f in clm.data_files([str(tmp_path)])] == ["a.jsonl"]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(f"warning: {tmp_path}: 1 file of a type not read left out, the first")
    assert "more.csv: not a file type xlafit reads" in said[0] and "convert it to JSON lines or Parquet" in said[0]


def test_grpo_prompts_of_a_split_folder_are_its_train_split_and_it_says_so(tok, tmp_path):
    """A GRPO run has no evaluation: its prompts are the folder's train split alone, and it
    says that the evaluation files are not read."""
    from xlafit.data.prompts import load_prompts

    prompts = [{"prompt": p["prompt"], "answer": p["completion"]} for p in PAIRS]
    _jsonl(tmp_path / "train-00000.jsonl", prompts[:8])
    _jsonl(tmp_path / "test-00000.jsonl", prompts[8:])
    said = []
    found = load_prompts([str(tmp_path)], tok, None, (), group=2, progress=said.append)
    assert found.prompts == [p["prompt"] for p in prompts[:8]]
    assert said[0] == f"reading the train split of {tmp_path}: its evaluation file is not read", said
