"""The bert recipe: the Korean demo corpus built once, then the model and its loss on it."""

import jax.numpy as jnp
import numpy as np
import pytest

from xlafit.recipes import bert as recipe
from xlafit.recipes import load_config


def test_demo_corpus_is_built_once_into_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path))
    cfg = load_config("bert", ["data.vocab_size=1000"])
    train, evaluation = recipe.load_data(cfg)
    assert "building the Korean demo corpus" in capsys.readouterr().out
    assert len(train) > 150 and len(evaluation) > 10 and train.vocab_size == 1000
    again, _ = recipe.load_data(cfg)
    assert "building" not in capsys.readouterr().out and again.location == train.location
    model = recipe.build_model(cfg, train)
    assert model.cfg.num_layers == 2 and model.cfg.hidden_size == 128  # the tiny preset
    losses, metrics = recipe.loss_fn(model, {k: jnp.asarray(v) for k, v in train.take(np.arange(4)).items()})
    assert losses.shape == (4,) and metrics["masked_accuracy"].shape == (4,)
    assert float(losses.mean()) == pytest.approx(np.log(1000), abs=0.5)  # untrained: about uniform


def test_eval_fraction_with_prepared_data_is_refused(tmp_path, monkeypatch, korean_tokenizer, capsys):
    """``data.eval_fraction`` with a data_dir was ignored (the split is the manifest's) yet
    recorded in the run's config.yaml as if it had been used."""
    from xlafit.cli import main
    from xlafit.data import mlm
    from xlafit.data.text import korean_demo_files

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    prepared = str(tmp_path / "mlm")
    mlm.prepare(korean_tokenizer, korean_demo_files(), prepared, seq_len=64, show_progress=False)
    run = tmp_path / "run"
    args = ["train", "bert", "--data-dir", prepared, "--run-dir", str(run), "data.eval_fraction=0.5"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"data.eval_fraction=0.5 but {prepared} was split into train and eval when it was prepared" in err
    assert "`xlafit data mlm --eval-fraction 0.5`" in err and not (run / "config.yaml").exists()
    train, evaluation = recipe.load_data(load_config("bert", [f"data.data_dir={prepared}"]))  # the default is fine
    assert len(train) > 100 and len(evaluation) > 0
    # The ninth walk: a BERT run said nothing of the data it read (the llm recipe's first line does).
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"data: {prepared}: {len(train)} sequences of 64 tokens, sentences packing (as prepared), vocabulary "
        f"{train.vocab_size}; eval: {len(evaluation)} sequences"
    )


def test_data_with_no_held_out_document_trains_without_evaluation(
    tmp_path, monkeypatch, korean_tokenizer, capsys, caplog
):
    """Two documents at --eval-fraction 0.05 hold none out: `data mlm` said nothing, and the
    run printed its start then a StopIteration traceback from compiling the eval step."""
    from xlafit.cli import main
    from xlafit.data.text import korean_demo_files

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    prepared = tmp_path / "mlm"
    files = korean_demo_files()[:2]
    assert main(["data", "mlm", "--tokenizer", str(korean_tokenizer), "--input", *files, "--doc-boundary", "file",
                 "--seq-len", "64", "--out", str(prepared)]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "--eval-fraction 0.05 held out no document (--doc-boundary file)" in err
    run = tmp_path / "run"
    args = ["train", "bert", "--simulate", "8", "--data-dir", str(prepared), "--run-dir", str(run)]
    assert main([*args, "trainer.stop_at_step=1", "data.global_batch=8"]) == 0
    assert "the evaluation set holds no examples: this run trains without evaluation" in caplog.text


def test_sequence_length_and_vocabulary_come_from_the_data():
    from helpers import mlm_dataset
    from xlafit.errors import ConfigError

    data = mlm_dataset(n=40, t=64, vocab=1000)
    data.location = "prepared/mlm"
    cfg = load_config("bert", ["data.data_dir=prepared/mlm"])
    assert cfg.data.seq_len is None and cfg.data.vocab_size is None  # nothing to set by hand
    used = recipe.from_data(cfg, data)
    assert (used.data.seq_len, used.data.vocab_size) == (64, 1000)  # what config.yaml records
    with pytest.raises(ConfigError, match="data.seq_len=128 but prepared/mlm holds sequences of 64 tokens"):
        recipe.from_data(load_config("bert", ["data.data_dir=prepared/mlm", "data.seq_len=128"]), data)
    with pytest.raises(ConfigError, match="data.vocab_size=2000 but the tokenizer of prepared/mlm has 1000"):
        recipe.from_data(load_config("bert", ["data.data_dir=prepared/mlm", "data.vocab_size=2000"]), data)
    # a setting that agrees is fine
    agreed = load_config("bert", ["data.data_dir=prepared/mlm", "data.seq_len=64"])
    assert recipe.from_data(agreed, data).data.seq_len == 64
    # The twenty-fourth walk: data.packing=pairs on data prepared with sentences was dropped without
    # a word, and config.yaml recorded pairs
    data.packing = "pairs"
    assert recipe.from_data(cfg, data).data.packing == "pairs"  # what the data holds, recorded
    with pytest.raises(ConfigError, match="data.packing=sentences but prepared/mlm was prepared with --packing pairs"):
        recipe.from_data(load_config("bert", ["data.data_dir=prepared/mlm", "data.packing=sentences"]), data)
    # and xlafit eval --data of sequences of another length: refused, naming both
    from xlafit.run_eval import _check_sequence_length

    with pytest.raises(ConfigError, match=r"holds sequences of 64 tokens and the run trained at data.seq_len=128"):
        _check_sequence_length(load_config("bert", ["data.seq_len=128"]), data, "mlm128")


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("data.mask_prob=1.5", r"data.mask_prob=1.5 is the share of tokens masked .*above 0 and at most 1"),
        ("data.mask_prob=-0.5", r"data.mask_prob=-0.5 is the share"),
        ("data.mask_prob=0", r"data.mask_prob=0 is the share"),
        ("data.max_predictions=0", r"data.max_predictions=0 must be a positive number"),
    ],
)
def test_masking_settings_that_cannot_train_are_refused(override, says):
    """data.max_predictions=0 failed with numpy's "cannot reshape array of size 0"; a mask_prob
    outside (0, 1] was accepted (0 trained on nothing and still reported a masked accuracy)."""
    from xlafit.errors import ConfigError

    with pytest.raises(ConfigError, match=says):
        load_config("bert", [override])


def test_sequences_longer_than_the_position_table_are_refused_before_the_model_is_built():
    """Data prepared at --seq-len 600 failed with a traceback from inside the model."""
    from helpers import mlm_dataset
    from xlafit.errors import ConfigError

    data = mlm_dataset(n=4, t=600, vocab=1000)
    data.location = "prepared/mlm600"
    says = r"prepared/mlm600 holds sequences of 600 tokens, longer than model.max_position_embeddings=512; set mod"
    with pytest.raises(ConfigError, match=says):
        recipe.from_data(load_config("bert", ["data.data_dir=prepared/mlm600"]), data)
    longer = load_config("bert", ["data.data_dir=prepared/mlm600", "model.max_position_embeddings=600"])
    assert recipe.from_data(longer, data).data.seq_len == 600
