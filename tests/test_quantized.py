"""A quantized frozen base for LoRA (models/quantized.py, hf/quantized.py): Qwix's values
against a NumPy dequantization, the error against the bfloat16 base, the safetensors reader,
the refusals, and the trainer refusing to train quantized weights."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import qwix
from flax import nnx

from helpers import NF4
from xlafit.checkpoint import Checkpointer
from xlafit.config import LoraConfig
from xlafit.errors import ConfigError
from xlafit.hf import config_json
from xlafit.hf import llama as llama_hf
from xlafit.hf.config_json import config_from_hf
from xlafit.hf.quantized import from_hf_quantized
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.models.lora import ADAPTER, base_fingerprint, merge_lora
from xlafit.models.quantized import QuantizedLinear, quantized_layers
from xlafit.parallel.sharding import path_name
from xlafit.recipes.registry import load_config
from xlafit.run import with_lora


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
    refused = (
        r"lora.base_block=64 does not divide .*: 96 \(layers.\*.mlp.down_proj\); use lora.base_block=32 \(divides 96\)"
    )
    with pytest.raises(ConfigError, match=refused):
        with_lora(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), LoraConfig(rank=4, base_dtype="nf4"), seed=0)
    llama_hf.save_hf(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), tmp_path)
    with pytest.raises(ConfigError, match=r"96 \(layers.\*.mlp.down_proj\)"):  # before a tensor is read
        from_hf_quantized(tmp_path, "nf4", 64)
    # a run: refused with the config, before the run directory is written
    from xlafit.recipes import llm

    for source in ([f"model.init_from_hf={tmp_path}"], ["model.preset=custom", "model.num_layers=1",
                   "model.hidden_size=64", "model.num_heads=4", "model.intermediate_size=96"]):  # fmt: skip
        with pytest.raises(ConfigError, match=r"96 \(layers.\*.mlp.down_proj\); use lora.base_block=32"):
            llm.validate(load_config("llm", [*source, "lora.rank=4", "lora.base_dtype=nf4"]))


def test_every_layer_the_blocks_do_not_divide_is_named_at_once_with_a_block_that_divides_them_all():
    """The fifth walk: each refusal named one layer and a block the next layer refused (64 -> 32
    -> 16, three tries). One message names them all and the block that divides every one."""
    from xlafit.recipes import llm

    sizes = ["model.preset=custom", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
             "model.intermediate_size=48", "lora.rank=4", "lora.base_dtype=nf4"]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        llm.validate(load_config("llm", sizes))
    message = str(e.value)
    assert ": 48 (layers.*.mlp.down_proj); 32 (layers.*.mlp.gate_proj, layers.*.mlp.up_proj and 4 more);" in message
    assert "use lora.base_block=16 (divides every quantized layer's: 32, 48)" in message, message
    llm.validate(load_config("llm", [*sizes, "lora.base_block=16"]))  # the one retry works


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


# --------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny Llama checkpoint for the demo's tokenizer (data.vocab_size=400)."""
    d = tmp_path_factory.mktemp("tiny-hf")
    llama_hf.save_hf(LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=400), rngs=nnx.Rngs(0)), d)
    return d


@pytest.mark.skipif(
    os.environ.get("XLAFIT_STRESS") != "1",
    reason="about 95 s (three processes quantize the base): XLAFIT_STRESS=1 runs it (the suite's 25-minute budget)",
)
def test_a_quantized_base_run_killed_with_sigkill_resumes_exactly(tmp_path, tiny_hf):
    from tests.test_llm_recipe import XLAFIT, _final, _segment, env

    cache = tmp_path / "cache"
    cmd = lambda run: [  # noqa: E731
        *XLAFIT, "train", "llm", "--simulate", "2", "--run-dir", str(run), f"model.init_from_hf={tiny_hf}",
        "lora.rank=4", "lora.base_dtype=nf4", "lora.targets=q_proj,v_proj,down_proj", "data.vocab_size=400",
        "data.seq_len=64", "data.global_batch=16", "trainer.stop_at_step=8", "trainer.log_every_steps=1",
        "trainer.checkpoint_every_steps=1", "trainer.eval_every_epochs=100",
    ]  # fmt: skip
    whole = subprocess.run(cmd(tmp_path / "whole"), capture_output=True, text=True, env=env(cache), timeout=300)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    proc, seen, lines = _segment(cmd(tmp_path / "cut"), cache)
    seen.wait(timeout=300)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "".join(lines)[-3000:]
    resumed = subprocess.run(cmd(tmp_path / "cut"), capture_output=True, text=True, env=env(cache), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from checkpoint" in resumed.stdout
    assert _final(tmp_path / "cut") == _final(tmp_path / "whole")
    assert _final(tmp_path / "whole")[0] == 8
    ckpt = Checkpointer(tmp_path / "whole" / "checkpoints")
    saved = ckpt.restore_arrays(8)
    ckpt.close()
    names = {path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(saved)[0]}
    assert not [n for n in names if "qvalue" in n or "scale" in n]  # the base is not in the checkpoint


# peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing (not our code)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_adapter_of_a_quantized_base_applies_in_peft_and_the_merge_is_bfloat16(tmp_path, tiny_hf, monkeypatch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import xlafit
    from xlafit.export import export_hf
    from xlafit.generator import Generator
    from xlafit.hf.peft import load_peft_adapter

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    xlafit.train_and_evaluate(
        load_config(
            "llm",
            [
                f"run.run_dir={tmp_path / 'run'}",
                f"model.init_from_hf={tiny_hf}",
                "lora.rank=4",
                "lora.alpha=8",
                "lora.base_dtype=nf4",
                "lora.targets=q_proj,v_proj,up_proj",
                "data.vocab_size=400",
                "data.seq_len=64",
                "trainer.stop_at_step=2",
                "trainer.eval_every_epochs=100",
                "optimizer.learning_rate=0.05",
            ],
        )  # fmt: skip
    )
    export_hf(tmp_path / "run", tmp_path / "hf")
    ids = np.array([[0, 5, 17, 42, 99, 7, 300, 12], [0, 250, 3, 3, 8, 150, 77, 1]], np.int64)

    def hf_logits(model):
        with torch.no_grad():
            return model(torch.from_numpy(ids)).logits.float().numpy()

    # the adapter alone, on the unquantized base: PEFT computes what our model does with it
    ours = load_peft_adapter(llama_hf.from_hf(tiny_hf), tmp_path / "hf" / "adapter")
    expected = np.asarray(ours(jnp.asarray(ids)))
    assert np.abs(expected - np.asarray(llama_hf.from_hf(tiny_hf)(jnp.asarray(ids)))).max() > 1e-3  # it learned
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "hf" / "adapter")
    np.testing.assert_allclose(hf_logits(with_adapter), expected, atol=1e-4, rtol=1e-4)
    # the merged model: bfloat16, the dequantized base plus the update, as the run's own model computes
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    run_model = load_peft_adapter(from_hf_quantized(tiny_hf, "nf4"), tmp_path / "hf" / "adapter")
    np.testing.assert_allclose(hf_logits(merged), np.asarray(run_model(jnp.asarray(ids))), atol=2e-2)
    # generate: the run's own model, its base still quantized, the adapters beside it
    ask = Generator.load(str(tmp_path / "run"))
    assert quantized_layers(ask.model) and len(ask(["What is 3 plus 4?"], max_new_tokens=2)) == 1


# --------------------------------------------------------------------------- host memory

# Loads a checkpoint into a 4-bit base in a process of its own, after JAX has started and the
# quantizing program compiled for each kernel shape; prints its resident memory just before
# and its peak while loading (VmHWM, reset by clear_refs), and the quantized model's bytes.
PROBE = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from xlafit.hf.quantized import from_hf_quantized
    from xlafit.models.quantized import param_bytes, quantize_kernel
    for shape in json.loads(sys.argv[2]):
        quantize_kernel(np.zeros(shape, np.float32), "nf4", 64)
    before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    model = from_hf_quantized(sys.argv[1], "nf4")
    peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"before": before, "peak": peak, "quantized": param_bytes(model)}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs")
def test_loading_a_4bit_base_holds_one_tensor_beside_the_quantized_model(tmp_path):
    """Host memory while a checkpoint is read into a 4-bit base: at most 1.5x the quantized
    model plus the largest tensor over the level before (measured 1.19x for this shape; the
    1B-shaped measurement is under benchmarks/results/2026-12-05/qlora/)."""
    from safetensors.numpy import save_file

    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_layers=4, num_heads=8,
                      num_kv_heads=2, tie_embeddings=False)  # fmt: skip
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    tensors = {
        name: (rng.standard_normal(llama_hf._hf_shape(param, row, t), np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        for name, param, row, t in llama_hf.entries(model)
    }
    largest = max(v.nbytes for v in tensors.values())
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({**config_json.hf_config(cfg), "torch_dtype": "bfloat16"}))
    del tensors
    h, q, kv, m = 512, 512, 128, 2048
    shapes = json.dumps([[h, q], [h, kv], [q, h], [h, m], [m, h]])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, not the suite's simulated 8
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), shapes], capture_output=True, text=True,
                         timeout=300, env={**env, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.splitlines()[-1])
    grew = measured["peak"] - measured["before"]
    assert measured["quantized"] < 80e6  # codes and scales, and the bfloat16 embeddings and output layer
    assert grew <= 1.5 * measured["quantized"] + largest, (grew, measured, largest)


def test_a_new_models_int4_base_trains_split_over_fsdp_and_tensor(tmp_path, monkeypatch, strategy8):
    """The pulse of a quantized base built inside jit (no model.init_from_hf), its codes and
    scales laid out by their logical axes over fsdp and tensor: the adapters train, the base
    stays what it was."""
    import xlafit

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    result = xlafit.train_and_evaluate(
        load_config(
            "llm",
            [
                f"run.run_dir={tmp_path / 'run'}",
                "lora.rank=4",
                "lora.base_dtype=int4",
                "lora.targets=q_proj,up_proj",
                "mesh.data=2",
                "mesh.fsdp=2",
                "mesh.tensor=2",
                "data.vocab_size=400",
                "data.seq_len=64",
                "data.global_batch=8",
                "trainer.stop_at_step=3",
                "trainer.eval_every_epochs=100",
            ],
        )  # fmt: skip
    )
    up = result.state.model_state["layers"][0]["mlp"]["up_proj"]["base_module"]
    codes, scales = up["qvalue"].get_value(), up["scale"].get_value()
    assert codes.dtype == jnp.uint8 and codes.shape == (32, 128)  # 64 input features, two a byte
    assert tuple(codes.sharding.spec) == ("fsdp", "tensor") and scales.sharding.spec[1] == "tensor"  # as the kernel
    trained = result.state.params["layers"][0]["mlp"]["up_proj"]["lora_b"][...]
    assert float(jnp.abs(trained).max()) > 0
    assert all(np.isfinite(row["loss"]) for row in result.history)


def test_a_quantized_base_counts_the_parameters_it_stands_for():
    """The sixteenth walk: `check --tpu` printed Llama 3.1 8B on an NF4 base as "4.66B
    parameters", its storage (two 4-bit codes a byte, and the scales), where the model and the
    same output's FLOPs have 8.03B; the count picks the step model's error band."""
    from xlafit.check import recipe_program
    from xlafit.predict.rates import parameter_count

    small = ["model.preset=custom", "model.num_layers=2", "model.hidden_size=128", "model.num_heads=2",
             "model.intermediate_size=256", "lora.rank=4", "data.demo=arithmetic", "data.seq_len=32"]  # fmt: skip
    counts = {}
    for base in ("bfloat16", "nf4", "int4", "int8"):
        tables = ["lora.quantize_embeddings=true"] if base != "bfloat16" else []  # quantized embeddings too
        program, _, _ = recipe_program("llm", [*small, f"lora.base_dtype={base}", *tables])
        counts[base] = parameter_count(program.model)
    assert len(set(counts.values())) == 1, counts
