"""The BERT model: Hugging Face parity and round trips, dropout, attention masks."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import hf_logits
from xlafit.errors import HFFormatError
from xlafit.hf.bert import from_hf, save_hf, to_hf_state
from xlafit.models.bert import BertConfig, BertForMaskedLM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


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
    back = from_hf(tmp_path)
    a, b = nnx.state(model, nnx.Param), nnx.state(back, nnx.Param)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    _, info = transformers.BertForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # and HF -> xlafit: weights that HF initialised itself
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**json.loads((tmp_path / "config.json").read_text())))
    hf.save_pretrained(tmp_path / "hf")
    imported = from_hf(tmp_path / "hf")
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
    model = from_hf(tmp_path)
    ours = [np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))) for _ in range(2)]
    np.testing.assert_array_equal(ours[0], ours[1])  # no dropout
    np.testing.assert_allclose(ours[0], hf_logits(tmp_path, ids, mask, types), atol=1e-4, rtol=0)


def test_from_hf_names_the_problem(tmp_path):
    with pytest.raises(HFFormatError, match="no config.json"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(HFFormatError, match="not BERT"):
        from_hf(tmp_path)
    save_hf(BertForMaskedLM(BertConfig.preset("tiny", vocab_size=100), rngs=nnx.Rngs(0)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "num_attention_heads": 2}))
    with pytest.raises(HFFormatError, match=r"word_embeddings.weight has shape \(100, 128\), expected \(100, 64\)"):
        from_hf(tmp_path)
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
        from_hf(tmp_path / "untied")
