"""ResNet: parameter counts, Hugging Face parity and round trips, batch norm modes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from xlafit.config import TrainerConfig
from xlafit.errors import HFFormatError
from xlafit.hf.resnet import from_hf, save_hf, to_hf_state
from xlafit.models.resnet import (
    BatchNorm,
    ResNet,
    ResNetConfig,
    batch_norm_train,
    max_pool_3x3_stride2,
    parameter_count,
    train_flops_per_example,
)
from xlafit.parallel.sharding import logical_axes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("depth", "count"),
    [(18, 11_689_512), (34, 21_797_672), (50, 25_557_032), (101, 44_549_160), (152, 60_192_808)],
)
def test_parameter_counts_are_torchvisions(depth, count):
    model = nnx.eval_shape(lambda: ResNet(depth, 1000, rngs=nnx.Rngs(0)))
    assert parameter_count(model) == count


def test_resnet50_layout_and_training_flops():
    model = nnx.eval_shape(lambda: ResNet(50, 1000, rngs=nnx.Rngs(0)))
    block = model.stages[1][0]  # v1.5: the first block of stage 2 downsamples on its 3x3 convolution
    assert [c.conv.strides for c in block.convs] == [(1, 1), (2, 2), (1, 1)]
    assert block.shortcut is not None and block.shortcut.conv.strides == (2, 2)
    # 4.09 GMAC forward (torchvision's figure) x 2 FLOPs x 3, less the stem's input gradient.
    assert train_flops_per_example(model.cfg) == pytest.approx(24.30e9, rel=1e-3)


@pytest.mark.parametrize("size", [8, 9])
def test_max_pool_gradient_goes_to_the_first_maximum_as_pytorchs(size):
    # Small whole numbers: many windows hold their maximum twice, so the tie rule shows.
    x = np.random.default_rng(0).integers(0, 4, (2, size, size, 3)).astype(np.float32)
    g = np.random.default_rng(1).standard_normal((2, (size + 1) // 2, (size + 1) // 2, 3)).astype(np.float32)
    ours = jax.vjp(max_pool_3x3_stride2, jnp.asarray(x))[1](jnp.asarray(g))[0]
    xt = torch.tensor(x).permute(0, 3, 1, 2).requires_grad_()
    torch.nn.functional.max_pool2d(xt, 3, 2, 1).backward(torch.tensor(g).permute(0, 3, 1, 2))
    # the same inputs get gradient; where several windows pick one input, the sums' order differs
    theirs = xt.grad.permute(0, 2, 3, 1).numpy()
    np.testing.assert_array_equal(np.asarray(ours) != 0, theirs != 0)
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-6, atol=1e-7)


# Hugging Face layouts: microsoft/resnet-50's (small), basic blocks, HF's own test config
# (sizes that are not powers of two, reduction 30 // 4 = 7) and the v1 flags.
HF_CONFIGS = {
    "bottleneck": dict(embedding_size=8, hidden_sizes=[16, 32, 64, 128], depths=[1, 2, 1, 1], layer_type="bottleneck"),
    "basic": dict(embedding_size=8, hidden_sizes=[8, 16, 24, 32], depths=[2, 1, 1, 1], layer_type="basic"),
    "hf-tester": dict(embedding_size=10, hidden_sizes=[10, 20, 30, 40], depths=[1, 1, 2, 1], layer_type="bottleneck"),
    "v1-flags": dict(
        embedding_size=8,
        hidden_sizes=[16, 32],
        depths=[1, 2],
        layer_type="bottleneck",
        downsample_in_bottleneck=True,
        downsample_in_first_stage=True,
    ),
}


def _random_hf(config, num_labels=7, seed=0):
    """A Hugging Face ResNetForImageClassification with every tensor moved off its init
    (batch-norm scales, biases and running statistics included), in eval mode."""
    torch.manual_seed(seed)
    hf = transformers.ResNetForImageClassification(transformers.ResNetConfig(**config, num_labels=num_labels))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "normalization" in name or "classifier" in name:
                p.add_(0.2 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("running_mean"):
                b.add_(0.1 * torch.randn_like(b))
            elif name.endswith("running_var"):
                b.mul_(torch.rand_like(b) + 0.5)
    return hf.eval()


def _hf_logits(hf, images):
    with torch.no_grad():  # NHWC -> NCHW
        return hf(pixel_values=torch.tensor(images).permute(0, 3, 1, 2)).logits.numpy()


@nnx.jit
def _forward(model, images):
    """One compiled forward: op-by-op dispatch of a ResNet costs seconds per call here."""
    return model(images)


def _images(batch=3, size=48, seed=1):
    return np.random.default_rng(seed).standard_normal((batch, size, size, 3)).astype(np.float32)


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_from_hf_logits_equal_hugging_face(tmp_path, name):
    hf = _random_hf(HF_CONFIGS[name])
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert parameter_count(model) == sum(p.numel() for p in hf.parameters())
    images = _images(size=50 if name == "basic" else 48)  # an even and an odd feature-map size on the way down
    ours = np.asarray(_forward(model, jnp.asarray(images)))
    assert ours.shape == (3, 7)
    np.testing.assert_allclose(ours, _hf_logits(hf, images), atol=1e-4, rtol=0)


def test_export_loads_in_transformers_with_the_same_logits(tmp_path):
    model = ResNet(18, 5, width=8, rngs=nnx.Rngs(2))
    model.train()  # a few training-mode calls move the running statistics off 0 and 1
    for seed in range(3):
        _forward(model, jnp.asarray(_images(batch=4, size=32, seed=seed)))
    model.eval()
    for _, norm in nnx.iter_graph(model):  # scales off 0/1, biases off 0 (not the kernels: logits would reach 1e11)
        if isinstance(norm, BatchNorm):
            norm.scale.value = norm.scale.value + 0.1
            norm.bias.value = norm.bias.value + 0.1
    save_hf(model, tmp_path, labels=["a", "b", "c", "d", "e"])
    hf, info = transformers.ResNetForImageClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert hf.config.id2label[4] == "e"
    images = _images(batch=2, size=40)
    np.testing.assert_allclose(
        np.asarray(_forward(model, jnp.asarray(images))), _hf_logits(hf.eval(), images), atol=1e-4
    )
    back = from_hf(tmp_path)  # and the round trip is exact
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_train_mode_equals_hugging_faces_batch_statistics(tmp_path):
    """Training-mode forward (global batch statistics) and the running-mean update equal
    PyTorch's; PyTorch's running variance is the unbiased one, n / (n - 1) times ours."""
    hf = _random_hf(HF_CONFIGS["bottleneck"])
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    images = _images(batch=4, size=32)
    model.train()
    ours = np.asarray(_forward(model, jnp.asarray(images)))
    theirs = _hf_logits(hf.train(), images)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    hf_state = {k: v.numpy() for k, v in hf.state_dict().items()}
    for name, value in to_hf_state(model).items():
        if name.endswith("running_mean"):
            np.testing.assert_allclose(value, hf_state[name], atol=1e-5, err_msg=name)
    # running = 0.9 running + 0.1 batch in both; the stem's batch variance is over n values
    stem_var = "resnet.embedder.embedder.normalization.running_var"
    before = np.asarray(from_hf(tmp_path).stem.norm.var[...])
    ours_batch = (to_hf_state(model)[stem_var] - 0.9 * before) / 0.1
    torch_batch = (hf_state[stem_var] - 0.9 * before) / 0.1
    n = 4 * 16 * 16  # examples x positions of the stem's output
    np.testing.assert_allclose(torch_batch, ours_batch * n / (n - 1), rtol=1e-4)


def test_from_hf_with_a_new_head_keeps_the_backbone(tmp_path):
    hf = _random_hf(HF_CONFIGS["basic"], num_labels=1000)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path, num_classes=3, bn="local", bn_group=2, dtype="bfloat16")
    assert model.head.kernel[...].shape == (32, 3) and model.cfg.bn == "local"
    state = to_hf_state(model)
    for name, tensor in hf.state_dict().items():
        if not name.startswith("classifier.") and not name.endswith("num_batches_tracked"):
            np.testing.assert_array_equal(state[name], tensor.numpy(), err_msg=name)


def test_hf_errors_name_the_problem(tmp_path):
    with pytest.raises(HFFormatError, match="no config.json"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(HFFormatError, match="not a ResNet"):
        from_hf(tmp_path)
    save_hf(ResNet(18, 4, width=4, rngs=nnx.Rngs(0)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "embedding_size": 8}))
    with pytest.raises(HFFormatError, match=r"embedder.convolution.weight has shape \(4, 3, 7, 7\), expected"):
        from_hf(tmp_path)
    with pytest.raises(HFFormatError, match="small .* stem"):
        save_hf(nnx.eval_shape(lambda: ResNet(18, 4, width=4, small_stem=True, rngs=nnx.Rngs(0))), tmp_path / "s")
    with pytest.raises(ValueError, match="depth 20 is not one of"):
        ResNet(20, 10, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs bn_group"):
        ResNet(18, 10, bn="local", rngs=nnx.Rngs(0))


def test_bfloat16_computes_in_bf16_over_float32_state():
    f32 = ResNet(18, 10, small_stem=True, width=8, rngs=nnx.Rngs(0))
    bf16 = ResNet(18, 10, small_stem=True, width=8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    bf16.train()
    images = jnp.asarray(_images(batch=4, size=16))
    out = bf16(images)
    assert out.dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(nnx.state(bf16))} == {jnp.dtype(jnp.float32)}
    f32.train()
    np.testing.assert_allclose(np.asarray(out), np.asarray(f32(images)), atol=0.1)
    graphdef, state = nnx.split(bf16)
    hlo = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)).lower(state, images).as_text()
    convolutions = [line for line in hlo.splitlines() if "convolution(" in line]
    assert convolutions and all("bf16" in line for line in convolutions)


def test_local_batch_norm_uses_each_groups_statistics():
    norm = BatchNorm(3, group=2, momentum=0.9)
    norm.scale[...] = jnp.array([1.0, 2.0, 0.5])
    norm.bias[...] = jnp.array([0.0, 1.0, -1.0])
    norm.use_running_average = False
    x = np.random.default_rng(0).standard_normal((6, 4, 5, 3)).astype(np.float32) * 3 + 1
    y = np.asarray(norm(jnp.asarray(x)))
    means, variances = [], []
    for g in range(3):  # by hand, in float64: groups of 2 consecutive examples
        part = x[2 * g : 2 * g + 2].astype(np.float64)
        mean, var = part.mean((0, 1, 2)), part.var((0, 1, 2))
        expected = (part - mean) / np.sqrt(var + 1e-5) * [1.0, 2.0, 0.5] + [0.0, 1.0, -1.0]
        np.testing.assert_allclose(y[2 * g : 2 * g + 2], expected, atol=1e-5)
        means.append(mean)
        variances.append(var)
    np.testing.assert_allclose(norm.mean[...], 0.1 * np.mean(means, 0), atol=1e-6)
    np.testing.assert_allclose(norm.var[...], 0.9 + 0.1 * np.mean(variances, 0), atol=1e-6)
    with pytest.raises(ValueError, match="groups of 2 examples do not divide the batch of 5"):
        norm(jnp.asarray(x[:5]))


def test_batch_norm_over_one_value_per_channel_is_refused():
    """A review found ResNet-50 on 32 px images at batch 1 (a 1x1 last stage) giving the
    same logits for every image: one value per channel normalises to the bias."""
    norm = BatchNorm(3, group=1)
    norm.use_running_average = False
    with pytest.raises(ValueError, match=r"one value per channel \(groups of 1 example\(s\) at 1x1\).*small_stem"):
        norm(jnp.ones((4, 1, 1, 3)))
    assert norm(jnp.arange(24.0).reshape(4, 2, 1, 3)).shape == (4, 2, 1, 3)  # two values: fine
    norm.group = None
    assert norm(jnp.arange(24.0).reshape(8, 1, 1, 3)).shape == (8, 1, 1, 3)  # the batch's 8 values
    norm.use_running_average = True
    assert norm(jnp.ones((1, 1, 1, 3))).shape == (1, 1, 1, 3)  # evaluation: running averages, any size


@pytest.mark.parametrize("group", [None, 2])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_batch_norm_gradients_equal_pytorch_autograd(group, residual, relu):
    """batch_norm_train's closed-form VJP = PyTorch autograd of the plain formula in float64,
    for every input, with per-group statistics, a residual and ReLU (exact zeros included)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 3, 5, 6)) * 2 + 1).astype(np.float32)
    x[0, 0, 0] = x[1, 0, 0]  # repeated values, and (below) pre-activations that are exactly 0
    scale, bias = rng.standard_normal(6).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    scale[0] = 0.0  # a zero-initialised residual scale
    res = rng.standard_normal(x.shape).astype(np.float32)
    res[0, 0, 0] = 0.0
    bias[0] = 0.0  # with scale 0 and residual 0: y = 0 exactly at [0, 0, 0, 0]
    weight = rng.standard_normal(x.shape).astype(np.float32)
    shape = x.shape if group is None else (x.shape[0] // group, group, *x.shape[1:])
    axes = (0, 1, 2) if group is None else (1, 2, 3)

    def ours(x, scale, bias, res):
        out = batch_norm_train(
            x.reshape(shape), scale, bias, res.reshape(shape) if residual else None, axes, 1e-5, relu
        )[0]
        return (out.reshape(x.shape) * weight).sum()

    grads = jax.grad(ours, argnums=(0, 1, 2, 3))(*map(jnp.asarray, (x, scale, bias, res)))
    tx, ts, tb, tr = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x, scale, bias, res))
    xs = tx.reshape(shape)
    mean, var = xs.mean(axes, keepdim=True), xs.var(axes, keepdim=True, unbiased=False)
    y = (xs - mean) / torch.sqrt(var + 1e-5) * ts + tb
    y = y + tr.reshape(shape) if residual else y
    out = torch.relu(y) if relu else y
    (out.reshape(x.shape) * torch.tensor(weight, dtype=torch.float64)).sum().backward()
    for name, ours_grad, theirs in zip("x scale bias residual".split(), grads, (tx, ts, tb, tr), strict=True):
        expected = theirs.grad.numpy() if name != "residual" or residual else np.zeros_like(x)
        np.testing.assert_allclose(np.asarray(ours_grad), expected, rtol=1e-4, atol=1e-4, err_msg=name)


def test_batch_norm_under_mixed_precision_keeps_bf16_activations_and_float32_statistics():
    """bfloat16 in, bfloat16 out and bfloat16 input gradients; statistics and the scale's and
    bias's gradients in float32, and close to the float32 computation's."""
    rng = np.random.default_rng(0)
    x, res = (jnp.asarray(rng.standard_normal((4, 3, 3, 8)), jnp.float32) for _ in range(2))
    scale, bias = jnp.asarray(rng.standard_normal(8), jnp.float32), jnp.asarray(rng.standard_normal(8), jnp.float32)

    def run(dtype):
        def loss(x, scale, bias, res):
            out, mean, var = batch_norm_train(x, scale, bias, res, (0, 1, 2), 1e-5, True)
            assert out.dtype == dtype and mean.dtype == var.dtype == jnp.float32
            return (out.astype(jnp.float32) ** 2).sum()

        return jax.grad(loss, argnums=(0, 1, 2, 3))(x.astype(dtype), scale, bias, res.astype(dtype))

    low, full = run(jnp.bfloat16), run(jnp.float32)
    assert [g.dtype for g in low] == [jnp.bfloat16, jnp.float32, jnp.float32, jnp.bfloat16]
    for a, b in zip(low, full, strict=True):
        tolerance = 0.05 * float(jnp.abs(b).max())
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), rtol=0.05, atol=tolerance)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_batch_norm_backward_keeps_x_and_out_only(dtype):
    """The reason batch_norm_train has a custom VJP: its backward pass keeps x and out in x's
    dtype and per-channel vectors, where autodiff through the same formula keeps four float32
    tensors of x's size (a quarter of the bytes under bfloat16, half under float32)."""
    x = res = jnp.ones((4, 8, 8, 16), dtype)
    scale, bias = jnp.ones(16), jnp.zeros(16)

    def autodiff(x, scale, bias, res):
        xf = x.astype(jnp.float32)
        mean = xf.mean((0, 1, 2), keepdims=True)
        var = (xf * xf).mean((0, 1, 2), keepdims=True) - mean * mean
        y = (xf - mean) * jax.lax.rsqrt(var + 1e-5) * scale.reshape(1, 1, 1, -1) + bias.reshape(1, 1, 1, -1)
        y = y + res.astype(jnp.float32)
        return jnp.maximum(y, 0.0).astype(x.dtype)

    def ours(x, scale, bias, res):
        return batch_norm_train(x, scale, bias, res, (0, 1, 2), 1e-5, True)[0]

    def kept(f):  # the arrays of x's size that a jitted forward pass leaves for the backward
        pullback = jax.jit(lambda *args: jax.vjp(f, *args)[1])(x, scale, bias, res)
        return [a for a in jax.tree.leaves(pullback) if a.size == x.size]

    assert [(a.dtype, a.shape) for a in kept(ours)] == [(x.dtype, x.shape)] * 2
    assert sum(a.nbytes for a in kept(autodiff)) >= 4 * x.size * 4


def test_train_mode_gradients_equal_hugging_faces(tmp_path):
    """The whole model's gradients in training mode (batch statistics, the fused batch norm +
    residual + ReLU of every block) equal PyTorch autograd through Hugging Face's model."""
    hf = _random_hf(HF_CONFIGS["bottleneck"]).train()
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    model.train()
    images = _images(batch=4, size=32)
    weight = np.random.default_rng(2).standard_normal((4, 7)).astype(np.float32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        return (nnx.merge(graphdef, params, rest, copy=True)(jnp.asarray(images)) * weight).sum()

    grads = jax.jit(jax.grad(loss))(params)
    (hf(pixel_values=torch.tensor(images).permute(0, 3, 1, 2)).logits * torch.tensor(weight)).sum().backward()
    ours = to_hf_state(nnx.merge(graphdef, grads, rest))  # gradients laid out as Hugging Face's tensors
    checked = 0
    for name, p in hf.named_parameters():
        theirs = p.grad.numpy()
        np.testing.assert_allclose(ours[name], theirs, atol=2e-4 * max(1.0, np.abs(theirs).max()), err_msg=name)
        checked += 1
    assert checked == len(list(hf.parameters())) > 40


# --------------------------------------------------------------------------- batch norm in the trainer


def _tiny(bn="global", bn_group=None, **options):
    """Two basic blocks on 8x8 images: every kind of batch norm, compiled in seconds."""
    cfg = ResNetConfig(
        depths=(1, 1),
        hidden_sizes=(8, 16),
        embedding_size=8,
        bottleneck=False,
        num_classes=4,
        small_stem=True,
        bn=bn,
        bn_group=bn_group,
        zero_init_residual=False,  # blocks that are not the identity from the first step
        **options,
    )
    return ResNet(config=cfg, rngs=nnx.Rngs(0))


def _loss_fn(model, batch):
    logits = model(batch["image"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return losses, {"accuracy": (logits.argmax(-1) == batch["label"]).astype(jnp.float32)}


@pytest.fixture(scope="module")
def pictures():
    rng = np.random.default_rng(0)
    images = rng.standard_normal((64, 8, 8, 3)).astype(np.float32)
    labels = rng.integers(0, 4, 64).astype(np.int32)
    images += labels[:, None, None, None] * 0.5  # learnable
    return {"image": images, "label": labels}


def _trainer(strategy, model, run_dir=None, epochs=2, stop_at_step=None, **config):
    return xlafit.Trainer(
        model,
        _loss_fn,
        optax.sgd(0.1, momentum=0.9),
        strategy=strategy,
        global_batch=16,
        config=TrainerConfig(epochs=epochs, stop_at_step=stop_at_step, log_every_steps=4, **config),
        run_dir=run_dir,
    )


def _batch_stats(state):
    return jax.device_get(nnx.to_pure_dict(state.model_state))


# 8 steps of SGD on 8 devices vs 1: the runs differ only in the order of float sums (the
# all-reduce of the statistics and gradients). Measured: about 1e-7.
@pytest.mark.parametrize(("bn", "group"), [("global", None), ("local", 2)])
def test_batch_norm_on_8_devices_equals_1_device(strategy8, strategy1, pictures, bn, group):
    r8 = _trainer(strategy8, _tiny(bn, group)).fit(pictures, eval=pictures)
    r1 = _trainer(strategy1, _tiny(bn, group)).fit(pictures, eval=pictures)
    for a, b in ((r8.state.params, r1.state.params), (r8.state.model_state, r1.state.model_state)):
        for (path, x), y in zip(
            jax.tree.leaves_with_path(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)), strict=True
        ):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    stats = _batch_stats(r8.state)
    assert np.abs(stats["stem"]["norm"]["mean"]).max() > 1e-2  # the running averages moved
    assert r8.eval["loss"] == pytest.approx(r1.eval["loss"], rel=1e-5)


def test_fsdp_splits_the_convolutions_and_trains_what_one_device_does(strategy1, pictures):
    """The logical axes: convolutions split along their output channels over `fsdp`, batch
    norm and the classifier's 4 classes replicated (too small to split over 8). Global batch
    statistics under FSDP are those of the whole batch, as on 1 device (measured ~1e-7 apart)."""
    model = _tiny()  # the names themselves (the default rule alone would split these two the same way)
    assert logical_axes(model.stages[1][0].convs[0].conv.kernel) == ("kernel_h", "kernel_w", "conv_in", "conv_out")
    assert logical_axes(model.stem.norm.scale) == logical_axes(model.stem.norm.mean) == ("norm",)
    assert logical_axes(model.head.kernel) == ("embed", "classes")
    fsdp = xlafit.connect(mesh=(1, 8, 1))
    r8 = _trainer(fsdp, _tiny()).fit(pictures, eval=pictures)
    r1 = _trainer(strategy1, _tiny()).fit(pictures, eval=pictures)
    kernel = r8.state.params["stages"][1][0]["convs"][0]["conv"]["kernel"][...]  # (3, 3, 8, 16)
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, None, None, "fsdp")
    assert kernel.sharding.shard_shape(kernel.shape) == (3, 3, 8, 2)
    head = r8.state.params["head"]["kernel"][...]  # (16, 4): ("embed", "classes")
    assert head.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    for a, b in ((r8.state.params, r1.state.params), (r8.state.model_state, r1.state.model_state)):
        for (path, x), y in zip(
            jax.tree.leaves_with_path(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)), strict=True
        ):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert r8.eval["loss"] == pytest.approx(r1.eval["loss"], rel=1e-5)


def test_local_batch_norm_needs_no_communication(strategy8):
    """Groups of one device's examples: the forward pass has no collective; global statistics
    are all-reduced across the 8 devices."""
    images = jax.device_put(jnp.zeros((16, 8, 8, 3)), strategy8.batch)

    def collectives(model):
        model.train()
        graphdef, state = nnx.split(model)
        hlo = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, images).compile().as_text()
        return sum(hlo.count(op) for op in ("all-reduce", "all-gather", "collective-permute", "all-to-all"))

    assert collectives(_tiny("local", 2)) == 0
    assert collectives(_tiny("global")) > 0


def test_evaluation_uses_the_running_averages(strategy8, pictures):
    result = _trainer(strategy8, _tiny(), epochs=1).fit(pictures, eval=pictures)
    model = _tiny()
    state = jax.tree.map(jnp.asarray, jax.device_get((result.state.params, result.state.model_state)))
    nnx.update(model, *state)
    model.eval()
    logits = np.asarray(model(jnp.asarray(pictures["image"])))
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, pictures["label"]).mean()
    assert result.eval["loss"] == pytest.approx(float(expected), rel=1e-5)
    model.train()  # training-mode statistics give other logits: evaluation did not use them
    assert not np.allclose(np.asarray(model(jnp.asarray(pictures["image"]))), logits, atol=1e-3)


def test_resume_with_batch_statistics_is_bit_exact(strategy8, pictures, tmp_path):
    full = _trainer(strategy8, _tiny("local", 2)).fit(pictures, eval=pictures)
    first = _trainer(strategy8, _tiny("local", 2), run_dir=tmp_path, stop_at_step=3)
    first.fit(pictures)
    first.close()
    second = _trainer(strategy8, _tiny("local", 2), run_dir=tmp_path)
    resumed = second.fit(pictures, eval=pictures)
    second.close()
    assert int(resumed.state.step) == 8
    for a, b in ((resumed.state.params, full.state.params), (resumed.state.model_state, full.state.model_state)):
        for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)), strict=True):
            np.testing.assert_array_equal(x, y)
    assert resumed.eval == full.eval


def test_a_nonfinite_batch_leaves_the_batch_statistics_alone(strategy8, pictures):
    poisoned = {k: v.copy() for k, v in pictures.items()}
    poisoned["image"][:] = np.nan
    trainer = _trainer(strategy8, _tiny(), epochs=1, nan_policy="skip")
    before = _batch_stats(trainer.state)
    result = trainer.fit(poisoned)
    for x, y in zip(jax.tree.leaves(_batch_stats(result.state)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_resnet_run_exports_to_hugging_face(tmp_path):
    """The recipe's run -> ``xlafit export hf`` -> ``from_pretrained``: the same logits, with
    the running statistics the run trained."""
    from xlafit.export import export_hf
    from xlafit.recipes import load_config
    from xlafit.run import train_and_evaluate

    overrides = [
        "data.source=synthetic",
        "data.synthetic_examples=16",
        "data.synthetic_classes=5",
        "data.image_size=16",
        "data.global_batch=8",
        "model.preset=resnet18",
        "model.width=4",
        "trainer.epochs=1",
        f"run.run_dir={tmp_path / 'run'}",
    ]
    cfg = load_config("resnet", overrides=overrides)
    train_and_evaluate(cfg)
    out, step, *_ = export_hf(tmp_path / "run", tmp_path / "hf")
    assert step == 2
    hf, info = transformers.ResNetForImageClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    model = from_hf(out)
    assert np.abs(np.asarray(model.stem.norm.mean[...])).max() > 1e-3  # trained statistics, not the initial zeros
    images = _images(batch=2, size=16)
    np.testing.assert_allclose(
        np.asarray(_forward(model, jnp.asarray(images))), _hf_logits(hf.eval(), images), atol=1e-4
    )


def test_exporting_a_small_stem_run_is_a_usage_error_not_a_traceback(tmp_path, monkeypatch, capsys):
    """resnet_hf's HFFormatError is the one the command reports (it once had a class of its
    own, and `xlafit export hf` of a small-stem run ended in a traceback, exit 1)."""
    import xlafit.export
    from xlafit.cli import main
    from xlafit.hf import bert as bert_hf

    assert HFFormatError is bert_hf.HFFormatError
    small = nnx.eval_shape(lambda: ResNet(18, 4, width=4, small_stem=True, rngs=nnx.Rngs(0)))
    # the export of a small-stem run's model, without training one: save_hf raises the same way
    monkeypatch.setattr(xlafit.export, "export_hf", lambda run, out, step: (save_hf(small, out), step))
    assert main(["export", "hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xlafit: error: this ResNet has the small (3x3, no max-pool) stem") and "Traceback" not in err
    assert "Train with model.small_stem=false" in err  # the fix, not only why
    assert not (tmp_path / "hf").exists()


def test_invariant_chunks_keep_the_chunks_mean_batch_statistics_on_8_and_1_devices(strategy8, strategy1, pictures):
    """trainer.invariant_chunks normalises each chunk alone (bn=local with groups of a chunk
    or less: the same forward as without chunks); the running averages are the chunks'
    mean in chunk order. Before, one device kept its last chunk's and 8 devices device 0's
    first chunk's: 0.24 apart after 4 steps. The parameters stay bit-identical; the running
    averages, which no gradient depends on, agree to rounding (measured 2e-7: XLA fuses
    their arithmetic differently in the 1- and the 8-device program)."""
    r8 = _trainer(strategy8, _tiny("local", 2), epochs=1, invariant_chunks=8).fit(pictures)
    r1 = _trainer(strategy1, _tiny("local", 2), epochs=1, invariant_chunks=8).fit(pictures)
    plain = _trainer(strategy1, _tiny("local", 2), epochs=1).fit(pictures)
    for x, y, z in zip(
        jax.tree.leaves(_batch_stats(r8.state)),
        jax.tree.leaves(_batch_stats(r1.state)),
        jax.tree.leaves(_batch_stats(plain.state)),
        strict=True,
    ):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(x, z, rtol=1e-5, atol=1e-6)  # float sums in another order
    assert np.abs(_batch_stats(r8.state)["stem"]["norm"]["mean"]).max() > 1e-2  # the running averages moved
    params8, params1 = jax.device_get(r8.state.params), jax.device_get(r1.state.params)
    for x, y in zip(jax.tree.leaves(params8), jax.tree.leaves(params1), strict=True):
        np.testing.assert_array_equal(x, y)


def test_from_hf_reads_a_sharded_checkpoint(tmp_path):
    """save_pretrained(max_shard_size=...) writes model-0000k-of-0000n.safetensors and an index
    instead of model.safetensors; from_hf refused it as having no model.safetensors."""
    hf = _random_hf(HF_CONFIGS["basic"])
    hf.save_pretrained(tmp_path / "whole")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="5KB")
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    whole, sharded = to_hf_state(from_hf(tmp_path / "whole")), to_hf_state(from_hf(tmp_path / "sharded"))
    assert whole.keys() == sharded.keys()
    for name in whole:
        np.testing.assert_array_equal(whole[name], sharded[name], err_msg=name)
