"""WordPiece tokenizers: Korean syllables kept, training reproducible across processes."""

import subprocess
import sys

import pytest

from xlafit.data.text import korean_demo_files
from xlafit.data.tokenizer import load_tokenizer, measure


def test_korean_tokenizer_keeps_syllables(korean_tokenizer):
    transformers = pytest.importorskip("transformers")
    tok = load_tokenizer(korean_tokenizer)
    text = "대한민국은 민주공화국이다. 모든 권력은 국민으로부터 나온다."
    enc = tok.encode(text)
    assert enc.tokens[0] == "[CLS]" and enc.tokens[-1] == "[SEP]"
    jamo = [t for t in enc.tokens if any("\u1100" <= c <= "\u11ff" or "\u3130" <= c <= "\u318f" for c in t)]
    assert not jamo, f"Hangul split into jamo: {jamo}"
    assert "대한민국" in tok.decode(enc.ids)
    stats = measure(tok, korean_demo_files())
    assert stats.unknown_rate < 0.01 and 1.0 < stats.tokens_per_word < 4.0, stats
    # the same ids through transformers
    auto = transformers.AutoTokenizer.from_pretrained(korean_tokenizer)
    assert auto(text)["input_ids"] == enc.ids


def test_tokenizer_training_is_reproducible_across_processes(tmp_path, korean_tokenizer):
    """The trainer's own order changes per process (tokenizers#1794); ours must not."""
    code = (
        "import sys; from xlafit.data.tokenizer import train_tokenizer; "
        "from xlafit.data.text import korean_demo_files; "
        "train_tokenizer(korean_demo_files(), 2000, sys.argv[1], show_progress=False)"
    )
    for name in ("a", "b"):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], check=True)
    for f in ("tokenizer.json", "vocab.txt"):
        assert (
            (tmp_path / "a" / f).read_bytes()
            == (tmp_path / "b" / f).read_bytes()
            == (korean_tokenizer / f).read_bytes()
        )
    # the "##x" tokens were special only during training: text spelling "##" is split normally
    tok = load_tokenizer(korean_tokenizer)
    assert tok.get_added_tokens_decoder().keys() == set(range(5))
    assert len(tok.encode("##은", add_special_tokens=False).tokens) == 3  # "#", "#", "은"; not one "##은"


def test_nfd_would_have_split_hangul(tmp_path):
    """Why strip_accents is off: with it, BERT's normaliser turns syllables into jamo."""
    from xlafit.data.tokenizer import new_tokenizer

    assert new_tokenizer(strip_accents=False).normalizer.normalize_str("한국") == "한국"
    assert new_tokenizer(strip_accents=True).normalizer.normalize_str("한국") != "한국"


def test_an_out_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    """``--out`` naming an existing file ended, after the training, in mkdir's FileExistsError traceback."""
    from xlafit.cli import main

    corpus = tmp_path / "a.txt"
    corpus.write_text("the cat sat on the mat\nthe dog sat on the log\n" * 20)
    taken = tmp_path / "b.txt"
    taken.write_text("the user's notes\n")
    args = ["tokenizer", "train", "--input", str(corpus), "--vocab-size", "500", "--out", str(taken)]
    assert main(args) == 2
    assert f"--out {taken} is a file; give a directory" in capsys.readouterr().err
    assert taken.read_text() == "the user's notes\n"


def test_an_out_that_holds_a_tokenizer_is_kept_unless_overwrite(tmp_path, capsys):
    """``--out`` over an earlier tokenizer replaced it without a word: data prepared with it
    (and runs trained on its token ids) no longer matched."""
    from xlafit.cli import main

    corpus = tmp_path / "a.txt"
    corpus.write_text("the cat sat on the mat\nthe dog sat on the log\n" * 20)
    args = ["tokenizer", "train", "--input", str(corpus), "--out", str(tmp_path / "tok")]
    assert main([*args, "--vocab-size", "500"]) == 0
    first = (tmp_path / "tok" / "tokenizer.json").read_bytes()
    assert main([*args, "--vocab-size", "400", "--lowercase"]) == 2
    assert "holds a tokenizer already, kept" in capsys.readouterr().err
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == first
    assert main([*args, "--vocab-size", "400", "--lowercase", "--overwrite"]) == 0
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() != first


@pytest.mark.parametrize("text", ['{"x": 1}', "garbage{"])
def test_a_tokenizer_json_that_is_not_one_is_named_with_the_fix(tmp_path, capsys, text):
    """``xlafit data mlm --tokenizer`` on a damaged or foreign tokenizer.json printed tokenizers'
    bare ``Exception: expected ...`` traceback."""
    from xlafit.cli import main

    (tmp_path / "badtok").mkdir()
    (tmp_path / "badtok" / "tokenizer.json").write_text(text)
    args = ["data", "mlm", "--tokenizer", str(tmp_path / "badtok"), "--input", *korean_demo_files()]
    assert main([*args, "--out", str(tmp_path / "mlm")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'badtok' / 'tokenizer.json'} is not a Hugging Face tokenizer.json (" in err
    assert "make one with `xlafit tokenizer train`" in err and "Traceback" not in err
