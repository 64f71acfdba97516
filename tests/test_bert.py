"""BERT: Hugging Face parity and round trips, tokenizer, MLM data and masking, the recipe."""

import hashlib
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xlafit.data import mlm
from xlafit.data.loader import DataError
from xlafit.data.text import korean_demo_files
from xlafit.data.tokenizer import load_tokenizer, measure, train_tokenizer
from xlafit.models.bert import BertConfig, BertForMaskedLM
from xlafit.models.bert_hf import HFFormatError, load_hf, save_hf, to_hf_state

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def korean_tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(korean_demo_files(), 2000, out, show_progress=False)
    return out


def hf_logits(directory, ids, mask, types):
    model = transformers.BertForMaskedLM.from_pretrained(directory).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types))
    return out.logits.numpy()


def inputs(vocab, batch=3, length=24, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, (batch, length))
    mask = np.ones((batch, length), np.int64)
    mask[1, length // 2 :] = 0  # a padded row
    mask[2, length - 3 :] = 0
    types = np.zeros((batch, length), np.int64)
    types[:, length // 3 :] = 1  # two segments
    return ids, mask, types


@pytest.mark.parametrize(
    "sizes",
    [
        {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64},
        {"num_layers": 3, "hidden_size": 48, "num_heads": 4, "intermediate_size": 96},
    ],
)
def test_logits_equal_hugging_face(tmp_path, sizes):
    cfg = BertConfig(vocab_size=211, max_position_embeddings=40, **sizes)
    model = BertForMaskedLM(cfg, rngs=nnx.Rngs(3))
    model.eval()
    save_hf(model, tmp_path)
    ids, mask, types = inputs(cfg.vocab_size)
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types)))
    theirs = hf_logits(tmp_path, ids, mask, types)
    assert ours.shape == theirs.shape == (3, 24, 211)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    # the gathered head equals the full head at those positions
    positions = jnp.array([[1, 5, 7], [0, 2, 11], [3, 4, 20]])
    gathered = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types), masked_positions=positions))
    np.testing.assert_allclose(gathered, np.take_along_axis(ours, np.asarray(positions)[..., None], 1), atol=1e-5)


def test_dropout_keeps_the_rate_and_the_mean():
    from xlafit.models.bert import Dropout

    x = jnp.ones((32, 64, 255))  # an odd last axis: the 16-bit draws are cut to fit
    for bits in (16, 32):
        layer = Dropout(0.1, bits=bits, rngs=nnx.Rngs(dropout=0))
        a, b = np.asarray(layer(x)), np.asarray(layer(x))
        assert abs((a > 0).mean() - 0.9) < 0.003 and abs(a.mean() - 1.0) < 0.004, bits
        assert 0.15 < (a != b).mean() < 0.21  # a new mask per call: 2 * 0.9 * 0.1 differ
        assert abs((a > 0).mean(axis=(0, 1))[-1] - 0.9) < 0.03  # the last column is masked too
        layer.eval()
        np.testing.assert_array_equal(layer(x), x)
    with pytest.raises(ValueError, match="hidden_dropout=1.0 must be in"):
        BertConfig(hidden_dropout=1.0)


def test_cudnn_attention_refuses_masks_it_cannot_express():
    """cuDNN takes padding as lengths; a left-padded mask must not be read as right padding."""
    cfg = BertConfig.preset("tiny", vocab_size=50, dtype="bfloat16", attention="cudnn")
    model = BertForMaskedLM(cfg, rngs=nnx.Rngs(0))
    ids = jnp.ones((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="right-padded attention masks"):
        model(ids, jnp.array([[0, 1, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="right-padded attention masks"):
        model(ids, jnp.array([[1, 0, 1, 1], [1, 1, 1, 1]]))


def test_hf_round_trip_is_exact_and_loads_without_missing_keys(tmp_path):
    cfg = BertConfig.preset("tiny", vocab_size=300, max_position_embeddings=64)
    model = BertForMaskedLM(cfg, rngs=nnx.Rngs(0))
    save_hf(model, tmp_path)
    back = load_hf(tmp_path)
    a, b = nnx.state(model, nnx.Param), nnx.state(back, nnx.Param)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    _, info = transformers.BertForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # and HF -> xlafit: weights that HF initialised itself
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**json.loads((tmp_path / "config.json").read_text())))
    hf.save_pretrained(tmp_path / "hf")
    imported = BertForMaskedLM.from_hf(tmp_path / "hf")
    state = to_hf_state(imported)
    for name, tensor in hf.state_dict().items():
        if name in state:
            assert np.array_equal(state[name], tensor.numpy()), name


def test_from_hf_logits_equal_the_checkpoint_in_eval_mode(tmp_path):
    """HF's own init (LayerNorms and biases moved off 1/0), three token types, left and
    middle padding; ``from_hf`` returns an eval-mode model like ``from_pretrained``."""
    torch.manual_seed(0)
    config = dict(vocab_size=500, hidden_size=96, num_hidden_layers=2, num_attention_heads=3)
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**config, intermediate_size=200, type_vocab_size=3))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "LayerNorm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ids, mask, types = inputs(500, batch=4, length=20, seed=1)
    mask[3, :4] = 0  # left padding
    mask[0, 8:10] = 0  # a hole in the middle
    types[0, -2:] = 2
    model = BertForMaskedLM.from_hf(tmp_path)
    ours = [np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))) for _ in range(2)]
    np.testing.assert_array_equal(ours[0], ours[1])  # no dropout
    np.testing.assert_allclose(ours[0], hf_logits(tmp_path, ids, mask, types), atol=1e-4, rtol=0)


def test_from_hf_names_the_problem(tmp_path):
    with pytest.raises(HFFormatError, match="no config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(HFFormatError, match="not BERT"):
        load_hf(tmp_path)
    save_hf(BertForMaskedLM(BertConfig.preset("tiny", vocab_size=100), rngs=nnx.Rngs(0)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "num_attention_heads": 2}))
    with pytest.raises(HFFormatError, match=r"word_embeddings.weight has shape \(100, 128\), expected \(100, 64\)"):
        load_hf(tmp_path)
    untied = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            tie_word_embeddings=False,
        )
    )
    untied.save_pretrained(tmp_path / "untied")
    with pytest.raises(HFFormatError, match="tie_word_embeddings=false"):
        load_hf(tmp_path / "untied")


def test_korean_tokenizer_keeps_syllables(korean_tokenizer):
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


@pytest.mark.parametrize("packing", ["sentences", "pairs"])
def test_prepare_is_deterministic_and_well_formed(korean_tokenizer, packing):
    files = korean_demo_files()
    m1 = mlm.prepare(korean_tokenizer, files, "memory://mlm-a", seq_len=64, packing=packing, show_progress=False)
    m2 = mlm.prepare(korean_tokenizer, files, "memory://mlm-b", seq_len=64, packing=packing, show_progress=False)
    assert m1["splits"] == m2["splits"]
    a, _ = mlm.load_split("memory://mlm-a", "train")
    b, _ = mlm.load_split("memory://mlm-b", "train")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    ids, types, length = a["input_ids"], a["token_type_ids"], a["length"]
    assert len(ids) == m1["splits"]["train"]["sequences"] > 100
    assert length.sum() == m1["splits"]["train"]["tokens"]
    assert (ids[:, 0] == mlm.CLS).all() and (ids[np.arange(len(ids)), length - 1] == mlm.SEP).all()
    assert ((np.arange(64)[None] < length[:, None]) | (ids == mlm.PAD)).all()  # padding only after the end
    if packing == "sentences":
        assert (length == 64).mean() > 0.9 and (types == 0).all()
    else:
        for row, n in zip(types[:50], length[:50], strict=True):
            change = np.flatnonzero(np.diff(row[:n]))
            assert len(change) == 1 and row[0] == 0 and row[n - 1] == 1  # A then B


def test_prepare_names_bad_input(tmp_path, korean_tokenizer):
    from xlafit.data.text import expand_inputs

    with pytest.raises(DataError, match="no input file matches"):
        expand_inputs([str(tmp_path / "nothing*.txt")])
    with pytest.raises(DataError, match="no tokenizer.json"):
        mlm.prepare(tmp_path, korean_demo_files(), str(tmp_path / "out"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt is not UTF-8"):
        mlm.prepare(korean_tokenizer, [str(tmp_path / "latin1.txt")], str(tmp_path / "out"), show_progress=False)
    out = tmp_path / "ok"
    mlm.prepare(korean_tokenizer, korean_demo_files(), str(out), seq_len=64, show_progress=False)
    shard = out / "train-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DataError, match="train-00000.parquet is damaged or was changed"):
        mlm.load_split(str(out), "train")
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["splits"]["train"]["shards"][0]["sha256"]  # as data prepared before checksums
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="train-00000.parquet cannot be read"):
        mlm.load_split(str(out), "train")


def test_split_is_decoded_once_into_a_memory_mapped_cache(tmp_path, monkeypatch, caplog, korean_tokenizer):
    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    url, files = str(tmp_path / "data"), korean_demo_files()
    manifest = mlm.prepare(korean_tokenizer, files, url, seq_len=64, shard_size=100, show_progress=False)
    shards = [tmp_path / "data" / s["path"] for s in manifest["splits"]["train"]["shards"]]
    assert len(shards) > 3
    mapped, _ = mlm.load_split(url, "train")
    in_memory, _ = mlm.load_split(url, "train", memory_map=False)
    assert all(isinstance(a, np.memmap) and not a.flags.writeable for a in mapped.values())
    assert all(np.array_equal(mapped[k], in_memory[k]) and mapped[k].dtype == in_memory[k].dtype for k in mapped)
    assert mapped["input_ids"].dtype == np.uint16 and len(mapped["length"]) == manifest["splits"]["train"]["sequences"]
    caches = lambda: sorted(p.name for p in (tmp_path / "cache" / "mlm").iterdir() if "-train-" in p.name)  # noqa: E731
    assert len(caches()) == 1
    monkeypatch.chdir(tmp_path)
    assert mlm.load_split("data", "train")[0]["input_ids"].filename == mapped["input_ids"].filename  # one key

    # A later load opens the cache and reads no shard.
    saved = {s: s.read_bytes() for s in shards}
    for s in shards:
        s.unlink()
    again, _ = mlm.load_split(url, "train")
    assert np.array_equal(again["input_ids"], in_memory["input_ids"])

    # A shard replaced by another valid one of the same size is caught by its checksum.
    for s, data in saved.items():
        s.write_bytes(data)
    shards[0].write_bytes(saved[shards[1]])
    with pytest.raises(DataError, match=f"{shards[0].name} is damaged or was changed"):
        mlm.load_split(url, "train", memory_map=False)

    # Prepared again (another seed): a new cache, the old one removed, and so is what a
    # process killed while decoding left a day ago.
    first = caches()
    stale = tmp_path / "cache" / "mlm" / "killed.abc.tmp"
    stale.mkdir()
    os.utime(stale, (time.time() - 2 * 86400,) * 2)
    mlm.prepare(korean_tokenizer, files, url, seq_len=64, shard_size=100, seed=1, show_progress=False)
    new, _ = mlm.load_split(url, "train")
    assert len(caches()) == 1 and caches() != first and not stale.exists()
    assert not np.array_equal(new["input_ids"][:100], in_memory["input_ids"][:100])

    # No writable cache: read into memory, with a warning that says where and why.
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "file"))
    with caplog.at_level("WARNING", logger="xlafit"):
        fallback, _ = mlm.load_split(url, "train")
    assert not isinstance(fallback["input_ids"], np.memmap) and np.array_equal(fallback["input_ids"], new["input_ids"])
    assert "reading it into memory" in caplog.text


def test_processes_building_one_split_cache_at_once_agree(tmp_path, korean_tokenizer):
    """Two processes of one host decode the same split into the cache at the same time (the
    start of a multi-process run): one rename wins, both read the same, nothing is left over."""
    url = str(tmp_path / "data")
    mlm.prepare(korean_tokenizer, korean_demo_files(), url, seq_len=64, shard_size=50, show_progress=False)
    code = (
        "import hashlib, sys; from xlafit.data import mlm; a, _ = mlm.load_split(sys.argv[1], 'train'); "
        "print(type(a['input_ids']).__name__, hashlib.sha256(a['input_ids'].tobytes()).hexdigest())"
    )
    env = {**os.environ, "XLAFIT_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, url], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    expected = mlm.load_split(url, "train", memory_map=False)[0]["input_ids"]
    assert outputs == [f"memmap {hashlib.sha256(expected.tobytes()).hexdigest()}"] * 2
    assert [p.name.split("-")[1] for p in (tmp_path / "cache" / "mlm").iterdir()] == ["train"]


def dataset(n=400, t=64, vocab=1000, **masking):
    rng = np.random.default_rng(0)
    length = rng.integers(10, t + 1, n)
    ids = rng.integers(5, vocab, (n, t)).astype(np.int32)
    ids[:, 0] = mlm.CLS
    ids[np.arange(n), length - 1] = mlm.SEP
    ids[np.arange(t)[None] >= length[:, None]] = mlm.PAD
    continuation = np.zeros(vocab, bool)
    continuation[500:] = True  # ids >= 500 are "##" pieces
    arrays = {"input_ids": ids, "token_type_ids": np.zeros_like(ids, np.int8), "length": length.astype(np.int32)}
    return mlm.MLMDataset(arrays, vocab, mlm.MaskingConfig(**masking), continuation)


def test_masking_rates_and_static_shapes():
    ds = dataset(max_predictions=20)
    batch = ds.take(np.arange(len(ds)), epoch=0)
    w = batch["masked_weights"]
    assert batch["masked_positions"].shape == batch["masked_ids"].shape == w.shape == (400, 20)
    real = ds.arrays["length"] - 2
    expected = np.minimum(20, np.maximum(1, np.rint(real * 0.15)))
    assert np.array_equal(w.sum(1), expected)
    rows, cols = np.nonzero(w)
    pos = batch["masked_positions"][rows, cols]
    original = ds.arrays["input_ids"][rows, pos]
    assert np.array_equal(batch["masked_ids"][rows, cols], original)
    assert not np.isin(original, [mlm.CLS, mlm.SEP, mlm.PAD]).any()
    now = batch["input_ids"][rows, pos]
    mask_share, same_share = (now == mlm.MASK).mean(), (now == original).mean()
    assert 0.77 < mask_share < 0.83 and 0.08 < same_share < 0.13  # 80% [MASK], 10% kept (+ random hits)
    unmasked = np.ones(ds.arrays["input_ids"].shape, bool)
    unmasked[rows, pos] = False
    assert np.array_equal(batch["input_ids"][unmasked], ds.arrays["input_ids"][unmasked])


def test_masks_are_a_function_of_seed_epoch_and_example():
    ds = dataset()
    whole = ds.take(np.arange(64), epoch=3)
    alone = ds.take(np.array([17]), epoch=3)  # another batch composition, the same example
    assert all(np.array_equal(whole[k][17], alone[k][0]) for k in whole)
    assert not np.array_equal(ds.take(np.arange(64), epoch=4)["masked_positions"], whole["masked_positions"])
    other_seed = dataset(seed=1).take(np.arange(64), epoch=3)
    assert not np.array_equal(other_seed["masked_positions"], whole["masked_positions"])


def test_whole_word_masking_takes_whole_words():
    ds = dataset(whole_word=True)
    batch = ds.take(np.arange(len(ds)), epoch=0)
    ids = ds.arrays["input_ids"]
    pieces = 0
    for r in range(len(ds)):
        chosen = set(batch["masked_positions"][r][batch["masked_weights"][r] > 0].tolist())
        for p in chosen:  # a chosen word's pieces (ids >= 500 continue the word before) are all chosen
            if ids[r, p + 1] >= 500:
                assert p + 1 in chosen, (r, p)
            if ids[r, p] >= 500 and p > 1:
                assert p - 1 in chosen, (r, p)
                pieces += 1
    assert pieces > 300  # the test saw many multi-piece words


def test_gradient_accumulation_equals_one_big_batch(strategy8):
    import optax

    import xlafit
    from xlafit.config import TrainerConfig
    from xlafit.recipes import bert as recipe

    ds = dataset(n=64, t=32, vocab=300)
    results = []
    for accumulate in (1, 4):
        cfg = BertConfig.preset("tiny", vocab_size=300, max_position_embeddings=32, hidden_dropout=0.0)
        trainer = xlafit.Trainer(
            BertForMaskedLM(cfg, rngs=nnx.Rngs(0)),
            recipe.loss_fn,
            optax.sgd(0.5),
            strategy=strategy8,
            global_batch=32,
            config=TrainerConfig(epochs=1, accumulate_steps=accumulate, log_every_steps=1),
        )
        result = trainer.fit(ds)
        results.append((result, jax.tree.leaves(nnx.to_pure_dict(result.state.params))))
    (a, pa), (b, pb) = results
    assert a.history[-1]["loss"] == pytest.approx(b.history[-1]["loss"], rel=1e-5)
    for x, y in zip(pa, pb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


def test_optimizers_lamb_and_polynomial_decay():
    from xlafit.config import OptimizerConfig
    from xlafit.train.optim import make_optimizer

    cfg = OptimizerConfig(
        name="lamb",
        learning_rate=1e-3,
        reference_batch=64,
        warmup_steps=10,
        decay="polynomial",
        decay_power=2.0,
        weight_decay=0.01,
        weight_decay_on="matrices",
    )
    plan = make_optimizer(cfg, 64, 110)
    assert float(plan.schedule(10)) == pytest.approx(1e-3)
    assert float(plan.schedule(60)) == pytest.approx(1e-3 * 0.5**2)  # (1 - 50/100) ** 2
    params = {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)}
    state = plan.tx.init(params)
    updates, _ = plan.tx.update({"kernel": jnp.zeros((3, 3)), "bias": jnp.zeros(3)}, state, params)
    # a zero gradient: only weight decay moves anything, and only the matrix (step 0: lr 0 in warmup)
    assert float(jnp.abs(updates["bias"]).max()) == 0.0


def xlafit_cli(*args, env=None, timeout=600):
    env = {**os.environ, **(env or {})}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-m", "xlafit", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_cli_tokenizer_data_train_export(tmp_path):
    """The whole pipeline through the command line, on the Korean texts, then Hugging Face."""
    files = korean_demo_files()
    out = xlafit_cli("tokenizer", "train", "--input", *files, "--vocab-size", "1500", "--out", str(tmp_path / "tok"))
    assert out.returncode == 0, out.stderr
    assert "unknown-token rate" in out.stdout and "tokens/word" in out.stdout
    out = xlafit_cli(
        "data",
        "mlm",
        "--tokenizer",
        str(tmp_path / "tok"),
        "--input",
        *files,
        "--seq-len",
        "64",
        "--out",
        str(tmp_path / "mlm"),
        "--eval-fraction",
        "0.1",
    )
    assert out.returncode == 0, out.stderr
    assert "train:" in out.stdout and "eval:" in out.stdout
    run_dir = tmp_path / "run"
    out = xlafit_cli(
        "train",
        "bert",
        "--simulate",
        "8",
        "--data-dir",
        str(tmp_path / "mlm"),
        "--run-dir",
        str(run_dir),
        "data.seq_len=64",
        "trainer.epochs=1",
        "data.global_batch=16",
    )
    assert out.returncode == 0, out.stderr
    assert "masked-token accuracy:" in out.stdout and "tokens_per_sec=" in out.stdout and "mfu=" in out.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1 for r in records if r["split"] == "train")
    out = xlafit_cli("export", "hf", str(run_dir), "--out", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    # the exported model: same logits in PyTorch as the checkpoint in xlafit
    model = BertForMaskedLM.from_hf(tmp_path / "hf")
    model.eval()
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    enc = auto(["대한민국 헌법 제1조", "국회의원 선거"], padding=True, return_tensors="np")
    ours = np.asarray(
        model(jnp.asarray(enc["input_ids"]), jnp.asarray(enc["attention_mask"]), jnp.asarray(enc["token_type_ids"]))
    )
    theirs = hf_logits(tmp_path / "hf", enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    out = xlafit_cli("export", "hf", str(tmp_path / "mlm"), "--out", str(tmp_path / "x"))
    assert out.returncode == 2 and "not a run directory" in out.stderr


def test_demo_corpus_is_built_once_into_the_cache(tmp_path, monkeypatch, capsys):
    from xlafit.recipes import bert as recipe
    from xlafit.recipes import load_config

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
