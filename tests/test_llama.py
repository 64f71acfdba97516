"""The Llama model: Hugging Face parity (Llama, Qwen2), checkpoints both ways, packed
segments, scan/remat, LoRA and its PEFT export."""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from helpers import long_form
from xlafit.data.clm import PackedText
from xlafit.data.shapes import pack
from xlafit.errors import ConfigError, HFFormatError
from xlafit.hf.llama import from_hf, save_hf
from xlafit.hf.peft import load_peft_adapter, save_peft_adapter
from xlafit.models.attention import packed_segments_limit, segment_offsets
from xlafit.models.bert import BertConfig, BertForMaskedLM
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.models.lora import ADAPTER, BASE, apply_lora, base_fingerprint, lora_state, merge_lora
from xlafit.parallel.sharding import DEFAULT_RULES, logical_axes, tree_specs
from xlafit.recipes.llm_data import check_packed_segments

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 256


def tiny(**overrides):
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
    return LlamaConfig(**{**sizes, "max_position_embeddings": 128, **overrides})


def random_model(cfg, seed=0):
    """A model whose every parameter (RMSNorm weights and biases too) is moved off its init, so
    each one shows in the logits: std-0.02 weights leave logits near 0 and hide errors (logits std here: about 1.7)."""
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 100)
    for _, var in nnx.state(model, nnx.Param).flat_state():
        key, sub = jax.random.split(key)
        var[...] = var[...] * 2.0 + 0.1 * jax.random.normal(sub, var[...].shape)
    return model


def token_ids(batch=2, length=24, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length))


def hf_logits(model_or_dir, ids):
    model = model_or_dir
    if not isinstance(model, torch.nn.Module):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_or_dir)
    with torch.no_grad():
        return model.eval()(torch.tensor(ids)).logits.numpy()


def logits(model, ids, **kwargs):
    return np.asarray(model(jnp.asarray(ids), **kwargs))


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # grouped-query attention (2 kv heads for 4), untied head
        {
            "tie_embeddings": True,
            "rope_type": "llama3",
            "rope_factor": 32.0,
            "rope_theta": 500000.0,
            "rope_original_max_position_embeddings": 16,
        },  # Llama 3.2's scaling, wavelengths on both sides of 4..16
        {"num_kv_heads": 4, "head_dim": 8},  # multi-head, head_dim != hidden / heads
        {"attention_bias": True},  # Qwen2ForCausalLM
    ],
    ids=["gqa", "tied-llama3-rope", "mha-head-dim", "qwen2"],
)
def test_logits_equal_hugging_face(tmp_path, overrides):
    model = random_model(tiny(**overrides))
    save_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    expected = "Qwen2ForCausalLM" if overrides.get("attention_bias") else "LlamaForCausalLM"
    assert type(hf).__name__ == expected
    ids = token_ids()
    ours = logits(model, ids)
    assert ours.shape == (2, 24, VOCAB) and ours.std() > 1.0  # logits large enough for 1e-4 to mean something
    np.testing.assert_allclose(ours, hf_logits(hf, ids), atol=1e-4, rtol=0)
    if overrides.get("rope_type") == "llama3":  # the scaling changes the logits: the test can see it
        plain = LlamaForCausalLM(tiny(**{**overrides, "rope_type": "default"}), rngs=nnx.Rngs(0))
        nnx.update(plain, nnx.state(model, nnx.Param))
        assert np.abs(logits(plain, ids) - ours).max() > 1e-2


def test_hf_sharded_checkpoints_load_both_ways(tmp_path):
    """transformers' own init and sharded save_pretrained -> from_hf (unrolled and scanned);
    save_hf's shards -> from_pretrained with nothing missing or unexpected."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.5,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    )
    hf = transformers.LlamaForCausalLM(config)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ids = token_ids(seed=1)
    expected = hf_logits(hf, ids)
    model = from_hf(tmp_path / "hf")
    np.testing.assert_allclose(logits(model, ids), expected, atol=1e-4, rtol=0)
    scanned = from_hf(tmp_path / "hf", scan_layers=True)
    np.testing.assert_allclose(logits(scanned, ids), expected, atol=1e-4, rtol=0)

    save_hf(scanned, tmp_path / "ours", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    np.testing.assert_allclose(hf_logits(back, ids), expected, atol=1e-5, rtol=0)


def test_from_hf_names_the_problem(tmp_path):
    with pytest.raises(HFFormatError, match="no config.json"):
        from_hf(tmp_path)
    save_hf(LlamaForCausalLM(tiny(), rngs=nnx.Rngs(0)), tmp_path, max_shard_bytes=None)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(
        HFFormatError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(96, 64\), expected \(80, 64\)"
    ):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False, "num_hidden_layers": 3}))
    with pytest.raises(HFFormatError) as missing:
        from_hf(tmp_path)
    assert str(missing.value) == (
        "the checkpoint has no tensor 'model.layers.2.input_layernorm.weight' (shape (64,)), which its config.json "
        "calls for: the weights and config.json disagree (a truncated copy, another family's checkpoint, or another "
        "model's config.json); check that both come from the same model and that every shard is there."
    )
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(
        HFFormatError, match="describes a 'gpt2' model; xlafit reads llama, qwen2, qwen3, mistral, gemma2, gemma3_text"
    ):
        from_hf(tmp_path)


def test_from_hf_names_the_tensors_it_does_not_read(tmp_path, caplog):
    """A tensor the config does not declare (a bias beside attention_bias=false) is named, as
    transformers' UNEXPECTED keys; a rotary buffer, which no model reads, is not."""
    from safetensors.numpy import load_file, save_file

    save_hf(LlamaForCausalLM(tiny(), rngs=nnx.Rngs(0)), tmp_path, max_shard_bytes=None)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        from_hf(tmp_path)
    assert not caplog.records
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        from_hf(tmp_path)
    assert [r.getMessage() for r in caplog.records] == [
        "warning: the checkpoint has 1 tensor the model does not read (model.layers.0.self_attn.q_proj.bias), left "
        "out: its config.json may not be the one its weights were saved with (a bias with attention_bias=false, "
        "another family's names); check that both come from the same model."
    ]


def test_packed_segments_equal_the_sequences_alone():
    model = random_model(tiny())
    first, second = token_ids(1, 10, seed=2)[0], token_ids(1, 14, seed=3)[0]
    row = np.concatenate([first, second, np.zeros(4, np.int64)])[None]  # 4 padding tokens
    segments = np.array([[1] * 10 + [2] * 14 + [0] * 4])
    positions = np.array([list(range(10)) + list(range(14)) + [0] * 4])
    packed = logits(model, row, segment_ids=jnp.asarray(segments), positions=jnp.asarray(positions))
    np.testing.assert_allclose(packed[0, :10], logits(model, first[None])[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[0, 10:24], logits(model, second[None])[0], atol=1e-5, rtol=0)
    # and without the segment ids the second sequence sees the first: the mask matters
    assert np.abs(logits(model, row, positions=jnp.asarray(positions))[0, 10:24] - packed[0, 10:24]).max() > 1e-2


def test_packed_rows_in_cudnns_layout_are_each_segments_start_and_length():
    rng = np.random.default_rng(0)
    documents = [list(range(int(n))) for n in rng.integers(1, 40, size=60)]
    segments = jnp.asarray(pack(documents, 64)["segment_ids"])
    limit = packed_segments_limit(64)
    starts, lengths = segment_offsets(segments, limit)
    assert starts.shape == (segments.shape[0], limit + 1) and lengths.shape == (segments.shape[0], limit)
    for row, first, length in zip(np.asarray(segments), np.asarray(starts), np.asarray(lengths), strict=True):
        ids = [i for i in np.unique(row) if i > 0]
        assert list(length[: len(ids)]) == [int((row == i).sum()) for i in ids] and set(length[len(ids) :]) == {-1}
        assert list(first[: len(ids)]) == [int(np.argmax(row == i)) for i in ids] and set(first[len(ids) :]) == {-1}


def test_cudnn_attention_takes_packed_rows_in_bf16_up_to_its_limit_of_segments(monkeypatch):
    model = LlamaForCausalLM(tiny(dtype="bfloat16", attention="cudnn"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="runs on NVIDIA GPUs .cuDNN.; this is cpu: use 'xla' or 'auto'"):
        model._implementation(None, 8)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # what the choice is on a GPU
    assert model._implementation(jnp.ones((1, 8), jnp.int32), 8) == "cudnn"  # packed rows included
    with pytest.raises(ValueError, match="needs dtype='bfloat16'"):
        LlamaForCausalLM(tiny(attention="cudnn"), rngs=nnx.Rngs(0))._implementation(None, 8)
    rows = PackedText({"segment_ids": np.array([[1, 1, 2, 3, 4, 5, 0, 0]]), "input_ids": np.zeros((1, 8))}, 50, 5)
    with pytest.raises(
        ConfigError, match="takes up to 2 documents packed in a row of 8 tokens; this data packs up to 5"
    ):
        check_packed_segments(rows)
    check_packed_segments(
        PackedText({"segment_ids": np.array([[1, 1, 1, 2, 2, 2, 0, 0]]), "input_ids": np.zeros((1, 8))}, 50, 2)
    )


@long_form(
    23,
    covered_by="test_gemma4.py's scanning test, gemma3_text (a scanned model's logits and gradients) and "
    "test_sharding.py::test_remat_trains_the_same_parameters",
)
def test_scan_layers_and_remat_give_the_same_logits_and_gradients(tmp_path):
    cfg = tiny()
    model = random_model(cfg)
    save_hf(model, tmp_path)
    ids = jnp.asarray(token_ids(seed=4))

    def loss(m):
        return jnp.mean(m(ids)[:, :-1] ** 2)

    # compiled: op by op, the scanned and rematerialised backward passes take most of a minute
    forward, gradient = nnx.jit(lambda m: m(ids)), nnx.jit(nnx.grad(loss))
    reference_logits = np.asarray(forward(model))
    reference_grads = nnx.state(gradient(model), nnx.Param)
    assert nnx.state(from_hf(tmp_path, scan_layers=True), nnx.Param)["layers"]["mlp"]["up_proj"]["kernel"].shape == (
        2,
        64,
        96,
    )
    for overrides in (
        {"remat": "full"},
        {"scan_layers": True},
        {"scan_layers": True, "remat": "dots_saveable"},
        {"remat": "offload"},  # the layer input in pinned host memory: on a CPU, the same memory
        {"scan_layers": True, "remat": "offload"},
        {"remat": "offload_attention"},  # and the attention's projections
    ):
        other = from_hf(tmp_path, **overrides)
        np.testing.assert_allclose(
            np.asarray(forward(other)), reference_logits, atol=1e-5, rtol=0, err_msg=str(overrides)
        )
        grads = nnx.state(gradient(other), nnx.Param)
        if overrides.get("scan_layers"):  # compare layer 1 of the stacked gradient with layer 1's
            grads, ref = grads["layers"]["self_attn"]["q_proj"]["kernel"][...][1], reference_grads["layers"][1]
            ref = ref["self_attn"]["q_proj"]["kernel"][...]
        else:
            grads, ref = jax.tree.leaves(grads), jax.tree.leaves(reference_grads)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(g, r, atol=1e-6, rtol=1e-4, err_msg=str(overrides))


def lora_model(cfg, targets=("q_proj", "v_proj", "down_proj"), seed=0):
    return apply_lora(random_model(cfg, seed), targets, rank=4, alpha=8.0, rngs=nnx.Rngs(7))


def as_if_trained(model, seed=1):
    """B off zero, as after some training: updates about as large as the weights they adapt."""
    key = jax.random.key(seed)
    for path, var in nnx.state(model, ADAPTER).flat_state():
        if path[-1] == "lora_b":
            key, sub = jax.random.split(key)
            var[...] = 0.05 * jax.random.normal(sub, var[...].shape)
    return model


def test_lora_starts_as_the_base_and_merges_to_the_same_logits():
    cfg = tiny()
    ids = token_ids(seed=5)
    base_logits = logits(random_model(cfg), ids)
    model = lora_model(cfg)
    np.testing.assert_array_equal(logits(model, ids), base_logits)  # lora_b = 0
    adapted = logits(as_if_trained(model), ids)
    assert np.abs(adapted - base_logits).max() > 0.1
    merged = merge_lora(model)
    assert not nnx.state(merged, ADAPTER) and type(merged.layers[0].self_attn.q_proj) is nnx.Linear
    np.testing.assert_allclose(logits(merged, ids), adapted, atol=1e-4, rtol=0)


def test_an_optimizer_on_the_adapters_leaves_the_base_alone():
    model = lora_model(tiny())
    base_before = jax.tree.map(np.asarray, nnx.state(model, BASE))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=ADAPTER)
    ids = jnp.asarray(token_ids(seed=6))

    def loss(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(ids)[:, :-1], ids[:, 1:]).mean()

    grads = nnx.grad(loss, argnums=nnx.DiffState(0, ADAPTER))(model)
    optimizer.update(model, grads)
    assert np.abs(np.asarray(model.layers[0].self_attn.q_proj.lora_b[...])).max() > 0  # B moved off 0
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(nnx.state(model, BASE)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_lora_state_is_the_adapters_alone():
    cfg = tiny()
    model = lora_model(cfg)
    h, q, kv, i, r = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, 96, 4
    per_layer = r * (h + q) + r * (h + kv) + r * (i + h)  # q_proj, v_proj, down_proj: A [in, r] + B [r, out]
    nbytes = sum(x.nbytes for x in jax.tree.leaves(lora_state(model)))
    assert nbytes == cfg.num_layers * per_layer * 4
    assert nbytes * 10 < sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, BASE)))


# peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing (not our code)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_adapter_loads_in_peft_and_back(tmp_path):
    peft = pytest.importorskip("peft")
    cfg = tiny()
    save_hf(random_model(cfg), tmp_path / "base")
    model = as_if_trained(lora_model(cfg))
    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    ids = token_ids(seed=7)
    ours = logits(model, ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert np.abs(hf_logits(hf, ids) - ours).max() > 0.1  # the adapter shows
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter")
    np.testing.assert_allclose(hf_logits(peft_model, ids), ours, atol=1e-4, rtol=0)

    back = load_peft_adapter(from_hf(tmp_path / "base"), tmp_path / "adapter")
    np.testing.assert_allclose(logits(back, ids), ours, atol=1e-5, rtol=0)
    scanned = load_peft_adapter(from_hf(tmp_path / "base", scan_layers=True), tmp_path / "adapter", check_base=False)
    np.testing.assert_allclose(logits(scanned, ids), ours, atol=1e-5, rtol=0)
    with pytest.raises(HFFormatError, match="trained on another base model"):
        load_peft_adapter(random_model(cfg, seed=1), tmp_path / "adapter")


def test_base_fingerprint_follows_the_base_weights_only():
    model = random_model(tiny())
    before = base_fingerprint(model)
    assert before == base_fingerprint(model, samples=256) != base_fingerprint(model, full=True)
    lora = apply_lora(model, ("q_proj",), rank=2, alpha=2.0, rngs=nnx.Rngs(0))
    assert base_fingerprint(lora) == before  # the adapters are not the base
    lora.layers[1].mlp.up_proj.kernel[...] = lora.layers[1].mlp.up_proj.kernel[...] + 1e-3
    assert base_fingerprint(lora) != before
    with pytest.raises(ConfigError, match="its Linear layers are named: .*gate_proj"):
        apply_lora(lora, ("query",), rank=2, alpha=2.0, rngs=nnx.Rngs(0))


def test_parameters_and_adapters_name_their_logical_axes():
    model = apply_lora(
        LlamaForCausalLM(tiny(scan_layers=True), rngs=nnx.Rngs(0)), ("k_proj",), rank=2, alpha=2.0, rngs=nnx.Rngs(1)
    )
    k_proj = model.layers.self_attn.k_proj
    assert logical_axes(k_proj.base_module.kernel) == ("layers", "embed", "kv_heads")
    assert logical_axes(k_proj.lora_a) == ("layers", "embed", None) and k_proj.lora_a.shape == (2, 64, 2)
    assert logical_axes(k_proj.lora_b) == ("layers", None, "kv_heads")
    assert logical_axes(model.embed_tokens.embedding) == ("vocab", "embed")
    assert logical_axes(model.lm_head.kernel) == ("embed", "vocab")
    specs = tree_specs(nnx.state(model), {"data": 1, "fsdp": 2, "tensor": 2}, DEFAULT_RULES)
    # out over tensor with its kernel; fsdp (ZeRO-3) takes the first free dimension it divides
    assert specs["layers"]["self_attn"]["k_proj"]["lora_b"].get_value() == PartitionSpec("fsdp", None, "tensor")


def test_lora_is_generic_over_linear_layers():
    """BERT's dense layers take adapters too (by their attribute names)."""
    bert = BertForMaskedLM(BertConfig.preset("tiny", vocab_size=50), rngs=nnx.Rngs(0))
    ids = jnp.ones((1, 8), jnp.int32)
    before = np.asarray(bert(ids))
    apply_lora(bert, ("intermediate", "output"), rank=2, alpha=4.0, rngs=nnx.Rngs(1))
    assert len(nnx.state(bert, ADAPTER).flat_state()) == 2 * 2 * 2  # 2 layers x 2 targets x (A, B)
    np.testing.assert_array_equal(np.asarray(bert(ids)), before)
