"""A quantized frozen base for LoRA (models/quantized.py, hf/quantized.py): Qwix's values
against a NumPy dequantization, the error against the bfloat16 base, the safetensors reader,
the refusals, and the trainer refusing to train quantized weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

from xlafit.config import LoraConfig
from xlafit.errors import ConfigError
from xlafit.hf import llama as llama_hf
from xlafit.hf.llama import config_from_hf
from xlafit.hf.quantized import from_hf_quantized
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.models.lora import ADAPTER, base_fingerprint, merge_lora
from xlafit.models.quantized import QuantizedLinear, quantized_layers
from xlafit.recipes.registry import load_config
from xlafit.run import with_lora

# NF4's 16 levels (Dettmers et al. 2023, appendix E), written out here rather than read from Qwix.
NF4 = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0,
    ]
)  # fmt: skip


def numpy_codes(stored: np.ndarray, qtype: str) -> np.ndarray:
    """The codes of a stored kernel: 4-bit ones two a byte, row 2i low, 2i + 1 high."""
    if qtype == "int8":
        return stored.astype(np.int64)
    low, high = (stored & 0xF).astype(np.int64), (stored >> 4).astype(np.int64)
    codes = np.empty((*stored.shape[:-2], 2 * stored.shape[-2], stored.shape[-1]), np.int64)
    codes[..., 0::2, :], codes[..., 1::2, :] = low, high
    return codes if qtype == "nf4" else np.where(codes >= 8, codes - 16, codes)  # int4: two's complement


def numpy_kernel(stored: np.ndarray, scale: np.ndarray, qtype: str) -> np.ndarray:
    """The kernel the stored values stand for: level times the scale of its block of rows."""
    codes = numpy_codes(stored, qtype)
    levels = NF4[codes] if qtype == "nf4" else codes.astype(np.float64)
    block = codes.shape[-2] // scale.shape[-2]
    return levels * np.repeat(scale.astype(np.float64), block, axis=-2)


@pytest.mark.parametrize("qtype", ["nf4", "int4", "int8"])
def test_the_base_weights_are_a_numpy_dequantization_of_qwix_values(qtype):
    layer = nnx.Linear(128, 48, rngs=nnx.Rngs(0), kernel_init=nnx.initializers.normal(0.05))
    q = QuantizedLinear.of(layer, qtype, block=64)
    stored, scale = np.asarray(q.qvalue.get_value()), np.asarray(q.scale.get_value())
    assert scale.shape == (2, 48) and stored.dtype == (np.int8 if qtype == "int8" else np.uint8)
    # the codes are Qwix's own, as qwix.quantize gives them for blocks of 64 rows per column
    theirs = qwix.quantize(layer.kernel.get_value(), "nf4" if qtype == "nf4" else jnp.dtype(qtype),
                           channelwise_axes=(1,), tiled_axes={0: 64})  # fmt: skip
    np.testing.assert_array_equal(numpy_codes(stored, qtype), np.asarray(theirs.qvalue).astype(np.int64))
    np.testing.assert_array_equal(scale, np.asarray(theirs.scale))
    expected = numpy_kernel(stored, scale, qtype)
    np.testing.assert_allclose(np.asarray(q.kernel()), expected, rtol=1e-6, atol=1e-7)
    x = np.asarray(jax.random.normal(jax.random.key(1), (4, 128)))
    np.testing.assert_allclose(np.asarray(q(jnp.asarray(x))), x @ expected + 0.0, rtol=1e-4, atol=1e-5)


# NF4's error on Gaussian weights, per layer: the relative RMS error of a layer's output
# (measured 0.092; int4 0.102, int8 0.006). Through whole random models (below) it compounds.
LAYER_ERROR = {"nf4": (0.08, 0.10), "int4": (0.09, 0.11), "int8": (0.004, 0.008)}


@pytest.mark.parametrize("qtype", sorted(LAYER_ERROR))
def test_a_layers_error_is_the_quantizations(qtype):
    layer = nnx.Linear(128, 256, rngs=nnx.Rngs(0), kernel_init=nnx.initializers.normal(0.02))
    x = jax.random.normal(jax.random.key(1), (64, 128))
    y, yq = layer(x), QuantizedLinear.of(layer, qtype, 64)(x)
    error = float(jnp.sqrt(jnp.mean((yq - y) ** 2) / jnp.mean(y**2)))
    low, high = LAYER_ERROR[qtype]
    assert low < error < high, error


SIZES = {"vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "initializer_range": 0.02}  # fmt: skip
FAMILIES = {
    "llama": {"model_type": "llama"},
    "qwen3": {"model_type": "qwen3", "tie_word_embeddings": False},
    "gemma3_text": {"model_type": "gemma3_text", "sliding_window": 8, "query_pre_attn_scalar": 32,
                    "layer_types": ["sliding_attention", "full_attention"]},
}  # fmt: skip
# The logits' relative RMS error against the bfloat16 base, tiny random models of each family
# (measured: NF4 0.18 Llama, 0.18 Qwen3, 0.30 Gemma 3; int8 0.011, 0.013, 0.020).
LOGIT_ERROR = {"nf4": 0.35, "int8": 0.03}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_stay_near_the_bfloat16_bases(family):
    cfg = config_from_hf({**SIZES, **FAMILIES[family]})
    ids = jax.random.randint(jax.random.key(0), (4, 32), 0, 256)
    logits = {}
    for dtype in ("bfloat16", *LOGIT_ERROR):
        model = with_lora(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), LoraConfig(rank=4, base_dtype=dtype), seed=0)
        logits[dtype] = np.asarray(model(ids), np.float64)
    ref = logits["bfloat16"]
    spread = np.mean((ref - ref.mean(-1, keepdims=True)) ** 2)
    for dtype, bound in LOGIT_ERROR.items():
        error = float(np.sqrt(np.mean((logits[dtype] - ref) ** 2) / spread))
        assert 0 < error < bound, (dtype, error)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_a_checkpoint_is_quantized_as_it_is_read(tmp_path, scan):
    model = LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=100), rngs=nnx.Rngs(0))
    llama_hf.save_hf(model, tmp_path)
    read = from_hf_quantized(tmp_path, "nf4", 64, scan_layers=scan)
    layers = dict(quantized_layers(read))
    assert len(layers) == (7 if scan else 14) and read.lm_head is not None
    assert read.lm_head.kernel.get_value().dtype == jnp.bfloat16  # the output layer stays unquantized
    for i in range(2):
        layer = read.layers if scan else read.layers[i]
        stored = np.asarray(layer.mlp.down_proj.qvalue.get_value())
        scale = np.asarray(layer.mlp.down_proj.scale.get_value())
        stored, scale = (stored[i], scale[i]) if scan else (stored, scale)
        original = np.asarray(model.layers[i].mlp.down_proj.kernel.get_value())
        theirs = qwix.quantize(jnp.asarray(original), "nf4", channelwise_axes=(1,), tiled_axes={0: 64})
        np.testing.assert_array_equal(numpy_codes(stored, "nf4"), np.asarray(theirs.qvalue).astype(np.int64))
        np.testing.assert_allclose(numpy_kernel(stored, scale, "nf4"), np.asarray(qwix.dequantize(theirs)), rtol=1e-6)
    # the same base as quantizing the full-precision model: one fingerprint for both ways
    lora = LoraConfig(rank=4, base_dtype="nf4")
    direct = with_lora(llama_hf.from_hf(tmp_path, scan_layers=scan), lora, seed=0)
    assert base_fingerprint(with_lora(read, lora, seed=0)) == base_fingerprint(direct)


def test_merging_into_a_quantized_base_gives_bfloat16_layers_of_the_dequantized_weights():
    model = LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=100), rngs=nnx.Rngs(0))
    model = with_lora(model, LoraConfig(rank=4, base_dtype="nf4", targets="q_proj"), seed=0)
    nnx.update(model, jax.tree.map(lambda a: a + 0.01, nnx.state(model, ADAPTER)))
    ids = jnp.arange(16)[None]
    before = model(ids)
    q = model.layers[0].self_attn.q_proj
    expected = q.base_module.kernel() + q.scaling * (q.lora_a[...] @ q.lora_b[...])
    merged = merge_lora(model)
    assert not quantized_layers(merged)
    kernel = merged.layers[0].self_attn.q_proj.kernel.get_value()
    assert kernel.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(expected.astype(jnp.bfloat16)))
    np.testing.assert_allclose(np.asarray(merged(ids)), np.asarray(before), atol=2e-2)


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["lora.base_dtype=nf4"], r"lora.base_dtype=nf4 quantizes the frozen base of a LoRA fine-tune, and lora.rank "
                                  r"is 0 .*set lora.rank \(e.g. lora.rank=16\)"),
        (["lora.rank=16", "lora.base_dtype=nf5"], r"lora.base_dtype.*nf5.*nf4"),
        (["lora.rank=16", "lora.base_dtype=nf4", "lora.base_block=0"], r"lora.base_block=0 must be positive"),
    ],
    ids=["nf4-without-rank", "unknown-dtype", "block-0"],
)  # fmt: skip
def test_quantized_base_settings_that_cannot_work_are_refused(overrides, error):
    with pytest.raises(ConfigError, match=error):
        load_config("llm", overrides)


def test_a_dimension_the_blocks_do_not_divide_is_refused_with_a_block_that_does(tmp_path):
    cfg = LlamaConfig.preset("tiny", vocab_size=100, intermediate_size=96)
    with pytest.raises(ConfigError, match=r"layers.0.mlp.down_proj has 96 input features, not a multiple of "
                                          r"lora.base_block=64 .*use lora.base_block=32 \(divides 96\)"):  # fmt: skip
        with_lora(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), LoraConfig(rank=4, base_dtype="nf4"), seed=0)
    llama_hf.save_hf(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), tmp_path)
    with pytest.raises(ConfigError, match=r"down_proj has 96 input features"):  # before a tensor is read
        from_hf_quantized(tmp_path, "nf4", 64)


def test_the_trainer_refuses_to_train_a_quantized_bases_weights(strategy1):
    import optax

    from xlafit import Trainer

    model = with_lora(
        LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=100), rngs=nnx.Rngs(0)),
        LoraConfig(rank=4, base_dtype="nf4"),
        seed=0,
    )
    with pytest.raises(ConfigError, match=r"quantized weights cannot be trained. Train LoRA adapters on it"):
        Trainer(model, lambda m, b: m(b["x"]).mean(), optax.sgd(0.1), strategy=strategy1, global_batch=1,
                trainable=nnx.Param)  # fmt: skip
