"""The named mesh, logical axes, FSDP and tensor parallelism (xlafit.parallel.sharding, devices.make_mesh).

Equivalence is measured as each parameter's relative L2 distance ``|a - b| / |b|`` to pure
data parallelism on the same 8 devices. The reference for "the same up to float rounding"
is DP itself on 4 devices instead of 8 (another all-reduce order): measured after 20 steps
on this tiny BERT, SGD 2.8e-7 (layouts: <= 3.9e-7) and AdamW 2.1e-5 (layouts: <= 3.2e-5;
Adam divides by sqrt(v), which magnifies the rounding of near-zero gradients). Hence the
tolerances: 1e-5 for SGD, 1e-4 for AdamW.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from helpers import long_form, mlm_dataset
from xlafit.checkpoint import Checkpointer, fingerprint, path_name
from xlafit.config import MeshConfig, TrainerConfig, validate_mesh
from xlafit.errors import ConfigError, DeviceError
from xlafit.models.bert import BertConfig, BertForMaskedLM
from xlafit.parallel.mesh import make_mesh
from xlafit.parallel.sharding import bytes_per_device, default_spec, parse_rules, spec_for
from xlafit.recipes import bert as recipe

STRESS = os.environ.get("XLAFIT_STRESS") == "1"  # the longer variants
TINY = BertConfig(
    vocab_size=64,
    num_layers=1,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    max_position_embeddings=16,
    hidden_dropout=0.0,
)
STEPS = 20
LAYOUTS = {"fsdp8": (1, 8, 1), "fsdp4xtp2": (1, 4, 2), "dp2xfsdp4": (2, 4, 1)}


def bert_trainer(mesh, tx, config=None, model=None, **kwargs):
    strategy = xlafit.connect(mesh=mesh)
    return xlafit.Trainer(
        model or (lambda: BertForMaskedLM(TINY, rngs=nnx.Rngs(0))),
        recipe.loss_fn,
        tx,
        strategy=strategy,
        global_batch=16,
        config=config or TrainerConfig(epochs=1, log_every_steps=STEPS),
        **kwargs,
    )


def params_of(state):
    return {k: np.asarray(v) for k, v in nnx.to_flat_state(state.params)}


def relative_l2(a, b):
    return max(float(np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)) for k in b)


@pytest.fixture(scope="module")
def data():
    return mlm_dataset(n=16 * STEPS, t=16, vocab=64)


@pytest.fixture(scope="module")
def dp_sgd(data):
    return params_of(bert_trainer((8, 1, 1), optax.sgd(0.5, momentum=0.9)).fit(data).state)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_train_the_parameters_of_data_parallelism(layout, data, dp_sgd, capsys):
    trainer = bert_trainer(LAYOUTS[layout], optax.sgd(0.5, momentum=0.9))
    state = trainer.fit(data).state
    if layout == "dp2xfsdp4":  # the start-up lines show the mesh
        out = capsys.readouterr().out
        assert "devices: 8 x cpu" in out and "per-device batch: 2" in out
        assert (
            "mesh: data=2 fsdp=4 tensor=1 -> parameters and optimizer state split over fsdp; "
            "batches split over data x fsdp (8 shards)"
        ) in out
        assert "MiB per device" in out
    assert relative_l2(params_of(state), dp_sgd) < 1e-5
    # and they really were split: the word embedding [vocab, hidden] is vocab x tensor, hidden x fsdp
    word = state.params["embeddings"]["word"]["embedding"][...]
    _, fsdp, tensor = LAYOUTS[layout]
    assert word.sharding.shard_shape(word.shape) == (64 // tensor, 32 // fsdp)


def test_fsdp_with_adamw_is_as_close_to_dp_as_dp_on_fewer_devices_and_holds_an_eighth(data):
    trainers = {mesh: bert_trainer(mesh, optax.adamw(1e-3)) for mesh in ((8, 1, 1), (1, 8, 1))}
    dp8, fsdp = (params_of(trainers[mesh].fit(data).state) for mesh in ((8, 1, 1), (1, 8, 1)))
    dp4 = xlafit.Trainer(
        lambda: BertForMaskedLM(TINY, rngs=nnx.Rngs(0)),
        recipe.loss_fn,
        optax.adamw(1e-3),
        strategy=xlafit.Strategy(make_mesh(jax.devices()[:4])),
        global_batch=16,
        config=TrainerConfig(epochs=1, log_every_steps=STEPS),
    )
    yardstick = relative_l2(params_of(dp4.fit(data).state), dp8)
    assert 0 < yardstick < 1e-4
    assert relative_l2(fsdp, dp8) < 1e-4
    # Parameters + optimizer state per device, as XLA's memory analysis of the compiled train
    # step counts its arguments, less the batch (the program fit() ran, from the step's cache).
    held = {}
    for mesh, trainer in trainers.items():
        _, _, batch = next(iter(trainer.batches(data)))
        memory = trainer.train_step.precompile(trainer.state, batch).memory_analysis()
        held[mesh] = memory.argument_size_in_bytes - bytes_per_device(batch)
        assert held[mesh] == pytest.approx(bytes_per_device(trainer.state), rel=0.01)  # our count agrees
        assert trainer.train_step.compiles == 1
    assert held[(1, 8, 1)] <= held[(8, 1, 1)] / 7, held


def test_state_is_created_sharded_and_fsdp_holds_an_eighth(capsys):
    dp = bert_trainer((8, 1, 1), optax.adamw(1e-3))
    fsdp = bert_trainer((1, 8, 1), optax.adamw(1e-3))
    held = lambda t: bytes_per_device((t.state.params, t.state.opt_state))  # noqa: E731
    assert held(fsdp) <= held(dp) / 7, (held(fsdp), held(dp))
    # Adam's moments lie exactly as their parameter
    kernel = fsdp.state.params["layers"][0]["intermediate"]["kernel"][...]
    mu = fsdp.state.opt_state[0].mu["layers"][0]["intermediate"]["kernel"][...]
    assert kernel.sharding.spec == mu.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    assert kernel.sharding.shard_shape(kernel.shape) == (4, 64)


def test_an_unannotated_model_is_split_along_its_largest_dimension(data):
    class Plain(nnx.Module):  # a user's model: no logical axes anywhere
        def __init__(self, rngs):
            self.hidden = nnx.Linear(8, 64, rngs=rngs)
            self.out = nnx.Linear(64, 3, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])

    rng = np.random.default_rng(0)
    arrays = {"x": rng.normal(size=(160, 8)).astype(np.float32), "y": rng.integers(0, 3, 160).astype(np.int32)}
    results = {}
    for mesh in ((8, 1, 1), (1, 8, 1)):
        trainer = xlafit.Trainer(
            lambda: Plain(nnx.Rngs(0)),
            loss_fn,
            optax.sgd(0.1),
            strategy=xlafit.connect(mesh=mesh),
            global_batch=16,
            config=TrainerConfig(epochs=1, log_every_steps=10),
        )
        results[mesh] = trainer.fit(arrays).state
    hidden = results[(1, 8, 1)].params["hidden"]["kernel"][...]
    assert hidden.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")  # 64 > 8
    out_bias = results[(1, 8, 1)].params["out"]["bias"][...]
    assert out_bias.sharding.is_fully_replicated  # 3 does not divide over 8
    assert relative_l2(params_of(results[(1, 8, 1)]), params_of(results[(8, 1, 1)])) < 1e-5


def test_a_builder_annotated_as_flax_shows_is_sharded_by_its_names():
    """nnx.with_partitioning with Flax's default eager sharding asked for a mesh with axes
    named "embed" and "mlp" when built; the trainer builds with it off, so the names go
    through the rules: embed -> fsdp, mlp -> tensor."""
    init = nnx.initializers.lecun_normal()

    class Annotated(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(8, 64, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
            self.out = nnx.Linear(64, 3, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.up(x)))

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])

    rng = np.random.default_rng(0)
    arrays = {"x": rng.normal(size=(64, 8)).astype(np.float32), "y": rng.integers(0, 3, 64).astype(np.int32)}
    trainer = xlafit.Trainer(
        lambda: Annotated(nnx.Rngs(0)),
        loss_fn,
        optax.sgd(0.1),
        strategy=xlafit.connect(mesh=(2, 2, 2)),
        global_batch=16,
        config=TrainerConfig(epochs=1, log_every_steps=0),
    )
    state = trainer.fit(arrays).state
    assert state.params["up"]["kernel"][...].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert np.isfinite(np.asarray(state.params["up"]["kernel"][...])).all()


def test_a_model_built_on_the_host_is_placed_slice_by_slice(data, dp_sgd):
    trainer = bert_trainer((1, 8, 1), optax.sgd(0.5, momentum=0.9), model=BertForMaskedLM(TINY, rngs=nnx.Rngs(0)))
    assert trainer.state.params["layers"][0]["output"]["kernel"][...].sharding.spec[0] is None  # 'mlp' -> tensor (1)
    assert relative_l2(params_of(trainer.fit(data).state), dp_sgd) < 1e-5


# --------------------------------------------------------------------------- errors


def test_a_mesh_that_does_not_cover_the_devices_is_one_clear_line():
    with pytest.raises(DeviceError, match=r"data=3 x fsdp=2 x tensor=1 has 6 places for 8 devices.*mesh.fsdp=2") as e:
        make_mesh(jax.devices(), 3, 2, 1)
    assert "--simulate" not in str(e.value)  # fewer places than devices: no rehearsal to offer
    # A plan's layout for a TPU slice, on fewer CPU devices (walk 25): mesh.data=-1 alone would
    # shrink a per-core batch's global batch; the rehearsal keeps it.
    with pytest.raises(DeviceError, match=r"has 16 places for 8 devices.* add --simulate 16 \(run.simulate_devices=16"):
        make_mesh(jax.devices(), 8, 2, 1)
    with pytest.raises(DeviceError, match="3 does not divide 8"):
        make_mesh(jax.devices(), -1, 3, 1)
    with pytest.raises(ConfigError, match="at most one of"):
        validate_mesh(MeshConfig(data=-1, fsdp=-1), TrainerConfig())


def test_a_dimension_that_does_not_divide_names_the_parameter_axis_and_sizes():
    mesh = {"data": 1, "fsdp": 8, "tensor": 3}
    with pytest.raises(ConfigError) as e:
        spec_for("layers/0/intermediate/kernel", (32, 64), ("embed", "mlp"), parse_rules(None), mesh)
    assert str(e.value).startswith("parameter layers/0/intermediate/kernel (32, 64): dimension 1 ('mlp', 64)")
    assert "mesh.tensor=3" in str(e.value) and "[1, 2, 4, 8, 16, 32, 64]" in str(e.value)
    # through the trainer, before anything is allocated
    strategy = xlafit.Strategy(make_mesh(jax.devices()[:6], 1, 2, 3))
    with pytest.raises(ConfigError, match=r"does not divide over mesh.tensor=3"):
        xlafit.Trainer(
            lambda: BertForMaskedLM(TINY, rngs=nnx.Rngs(0)), recipe.loss_fn, optax.sgd(0.1), strategy=strategy,
            global_batch=12,
        )  # fmt: skip


def test_rules_and_invariant_chunks_refusals():
    assert default_spec((10, 4096), {"fsdp": 8}) == jax.sharding.PartitionSpec(None, "fsdp")
    with pytest.raises(ConfigError, match="names no mesh axis"):
        parse_rules("embed=model")
    with pytest.raises(ConfigError, match="invariant_chunks keeps its bit-identical guarantee"):
        validate_mesh(MeshConfig(fsdp=8), TrainerConfig(invariant_chunks=8))


def test_a_rule_for_an_axis_no_parameter_carries_is_named_in_a_warning(caplog, monkeypatch):
    """`mesh.rules=embd=fsdp` (a typo of embed) was accepted in silence and the run laid out
    as if it were not there: the rule's name is checked against the axes the model's
    parameters carry, where the state's shardings are made, before anything is allocated.
    A warning, not an error: a name only activations carry (constrain) is a working rule.
    A default name sent elsewhere counts too (BERT has no kv_heads); a default left as it is,
    or an axis the model carries, passes."""
    from xlafit.parallel import sharding

    monkeypatch.setattr(sharding, "_WARNED", set())
    mesh = make_mesh(jax.devices(), -1, 1, 1)

    def trainer(rules):
        return xlafit.Trainer(
            lambda: BertForMaskedLM(TINY, rngs=nnx.Rngs(0)), recipe.loss_fn, optax.sgd(0.1),
            strategy=xlafit.Strategy(mesh, rules=parse_rules(rules)), global_batch=8,
        )  # fmt: skip

    for rules in ("embd=fsdp", "mlp=tensor,kv_heads=null"):
        caplog.clear()
        trainer(rules).close()
        stray = rules.split(",")[-1]
        assert (
            f"mesh.rules: {stray} names a logical axis that no parameter of this model carries (its axes are embed, "
            "heads, mlp, norm, positions, types, vocab). A misspelt name changes nothing: correct it."
        ) in caplog.text
    caplog.clear()
    trainer("kv_heads=tensor,heads=fsdp,classes=null").close()
    assert "mesh.rules" not in caplog.text


def test_a_rule_for_an_axis_only_activations_carry_lays_them_out(monkeypatch):
    """A model's own activation name (constrain) is no parameter's: the rule still works, so it
    is a warning, and the step compiles with it."""
    from xlafit.parallel import sharding
    from xlafit.parallel.sharding import constrain, logical

    monkeypatch.setattr(sharding, "_WARNED", set())

    class Net(nnx.Module):
        def __init__(self):
            init = logical(nnx.initializers.lecun_normal(), "embed", "mlp")
            self.fc = nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return constrain(self.fc(x), "batch", "act_hidden")

    mesh = make_mesh(jax.devices(), 2, 1, 4)
    t = xlafit.Trainer(
        Net, lambda m, b: (m(b["x"]) ** 2).mean(-1), optax.sgd(0.1),
        strategy=xlafit.Strategy(mesh, rules=parse_rules("act_hidden=tensor")), global_batch=8,
    )  # fmt: skip
    assert sharding.check_rules(t.state, parse_rules("act_hidden=tensor")) == ["act_hidden=tensor"]
    t.fit({"x": np.ones((16, 8), np.float32)})
    t.close()


def test_activation_embed_splits_the_llms_residual_stream_over_the_tensor_group(caplog, monkeypatch):
    """`mesh.rules=activation_embed=tensor`: the residual stream between decoder layers split
    over the tensor group (MaxText's activation_embed; with remat, a quarter of what it keeps
    at tensor 4): the same losses as without it, a reduce-scatter where the layers' outputs
    were all-reduced, and no warning (the name is an activation's, not a misspelt parameter's)."""
    from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
    from xlafit.parallel import sharding
    from xlafit.recipes.llm import loss_fn

    monkeypatch.setattr(sharding, "_WARNED", set())
    cfg = LlamaConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      vocab_size=64, max_position_embeddings=16, remat="full")  # fmt: skip
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (8, 16)).astype(np.int32)
    positions = np.broadcast_to(np.arange(16, dtype=np.int32), ids.shape).copy()
    batch = {"input_ids": ids, "segment_ids": np.ones_like(ids), "positions": positions, "loss_mask": np.ones_like(ids)}
    losses = {}
    for rules in ("", "activation_embed=tensor"):
        caplog.clear()
        t = xlafit.Trainer(
            lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), loss_fn, optax.sgd(0.1),
            strategy=xlafit.Strategy(make_mesh(jax.devices(), 1, 4, 2), rules=parse_rules(rules)), global_batch=8,
        )  # fmt: skip
        assert "mesh.rules" not in caplog.text
        losses[rules] = float(t.fit(batch).history[-1]["loss"])
        t.close()
    assert losses[""] == pytest.approx(losses["activation_embed=tensor"], rel=1e-5)


@long_form(40, "test_lever_fits.py::test_a_tensor_parallel_run_is_told_that_splitting_its_residual_stream_fits")
def test_activation_embed_keeps_a_quarter_of_the_layer_inputs_at_tensor_4_on_a_tpu():
    """The TPU compiler (libtpu, on this CPU), MaxText's remat policy (its "minimal") over
    scanned layers: what remat keeps between layers, a quarter at tensor 4."""
    from xlafit.check import recipe_program
    from xlafit.check.tpu import Steps, memory_of, no_persistent_cache
    from xlafit.parallel.cluster import start_backends
    from xlafit.platform import hardware as tpu

    start_backends()
    wide = [
        "model.preset=custom", "model.num_layers=2", "model.hidden_size=1024", "model.num_heads=8",
        "model.intermediate_size=2048", "model.vocab_size=512", "model.max_position_embeddings=256",
        "data.seq_len=256", "model.remat=dots_with_no_batch_dims_saveable", "model.scan_layers=true",
        "model.compute_dtype=bfloat16", "data.global_batch=16", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=4",
    ]  # fmt: skip
    temporaries = {}
    for rules in ("", "activation_embed=tensor"):
        program, _, _ = recipe_program("llm", [*wide, *([f"mesh.rules={rules}"] if rules else [])])
        with no_persistent_cache():
            steps = Steps(tpu.parse_target("v4-8"), program)
            compiled, _ = steps.compile_train(16)
        temporaries[rules] = memory_of(compiled, steps.state_bytes, 0)["temporaries"]
    kept = 2 * 16 * 256 * 1024 * 2  # each layer's input, bfloat16, whole on every device of the group
    assert temporaries[""] - temporaries["activation_embed=tensor"] > kept / 2, temporaries


def test_tensor_parallelism_splits_the_work_of_a_device(data):
    """Megatron over `tensor`: on 4 x 2, each device takes 1/4 of the batch and half the heads
    and MLP units, about the FLOPs of FSDP over 8 (1/8 of the batch, whole layers); without
    the split it would be twice those (XLA's cost analysis, per device)."""
    wide = dataclasses.replace(TINY, hidden_size=64, num_heads=4, intermediate_size=256)
    flops = {}
    for mesh in ((1, 8, 1), (1, 4, 2)):
        trainer = bert_trainer(mesh, optax.sgd(0.1), model=lambda: BertForMaskedLM(wide, rngs=nnx.Rngs(0)))
        _, _, batch = next(iter(trainer.batches(data)))
        flops[mesh] = trainer.train_step.flops_for(trainer.state, batch)
        mlp = trainer.state.params["layers"][0]["intermediate"]["kernel"][...]
        qkv = trainer.state.params["layers"][0]["attention"]["qkv"]["kernel"][...]
    assert mlp.sharding.shard_shape(mlp.shape) == (64 // 4, 256 // 2)
    # q, k and v (3, in, out) split by head: each device holds 2 of the 4 heads, 16 columns each
    assert qkv.shape == (3, 64, 64)
    assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert qkv.sharding.shard_shape(qkv.shape) == (3, 64 // 4, 64 // 2)
    assert flops[(1, 4, 2)] < 1.25 * flops[(1, 8, 1)], flops


# --------------------------------------------------------------------------- checkpoints across layouts


def test_a_checkpoint_restores_under_any_layout(tmp_path, data, strategy1):
    """Saved under FSDP over 8, restored onto DP on 1 device and onto FSDP x TP 4 x 2: the
    same bits, the same evaluation, and `xlafit inspect`'s fingerprint of the saved
    checkpoint equals that of the live, sharded parameters."""
    config = TrainerConfig(epochs=1, stop_at_step=4, log_every_steps=4)
    saver = bert_trainer((1, 8, 1), optax.adamw(1e-3), config=config, run_dir=tmp_path)
    saved = saver.fit(data)
    saver.close()
    expected = saver.evaluate(data)
    digest = fingerprint(Checkpointer(tmp_path / "checkpoints").restore_params(4))
    assert digest == fingerprint(saved.state.params)  # sharded, live
    for strategy in (strategy1, xlafit.connect(mesh=(1, 4, 2))):
        restorer = xlafit.Trainer(
            lambda: BertForMaskedLM(TINY, rngs=nnx.Rngs(1)),  # other initial values: all overwritten
            recipe.loss_fn,
            optax.adamw(1e-3),
            strategy=strategy,
            global_batch=16,
            config=config,
            run_dir=tmp_path,
        )
        state = restorer.fit(data).state  # restores checkpoint 4, trains nothing more
        restorer.close()
        assert int(state.step) == 4
        assert params_of(state).keys() == params_of(saved.state).keys()
        for k, v in params_of(saved.state).items():
            np.testing.assert_array_equal(params_of(state)[k], v)
        mu = state.opt_state[0].mu["layers"][0]["intermediate"]["kernel"][...]
        assert mu.sharding.mesh.shape == strategy.mesh.shape  # the optimizer state lies on the new mesh
        assert fingerprint(state.params) == digest
        got = restorer.evaluate(data)
        assert got["count"] == expected["count"]
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)


def test_a_checkpoint_of_the_older_qkv_layout_restores_into_the_per_head_one(tmp_path, data):
    """Checkpoints written before q, k and v were split by head hold BERT's [q|k|v] kernel as a
    (hidden, 3 * hidden) matrix (and the same for Adam's moments): they restore, onto FSDP x TP,
    with every value where the reshape puts it."""
    trainer = bert_trainer((1, 4, 2), optax.adamw(1e-3), config=TrainerConfig(epochs=1, stop_at_step=2))
    state = trainer.fit(data).state
    h = TINY.hidden_size

    def older(path, x):
        name = path_name(path).removesuffix("/value")
        if name.endswith("qkv/kernel"):  # (3, in, out) -> [q|k|v] columns
            return jnp.concatenate(list(x), axis=1)
        return x.reshape(3 * h) if name.endswith("qkv/bias") else x

    old = jax.tree_util.tree_map_with_path(older, state)
    assert old.params["layers"][0]["attention"]["qkv"]["kernel"][...].shape == (h, 3 * h)
    saver = Checkpointer(tmp_path)
    saver.save(2, old)
    saver.wait()
    restored, step = Checkpointer(tmp_path).restore(state)
    assert step == 2
    host = lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)  # noqa: E731
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert got.shape == want.shape and got.sharding == want.sharding
        np.testing.assert_array_equal(host(got), host(want))


# --------------------------------------------------------------------------- rematerialisation


def test_remat_trains_the_same_parameters(data):
    """model.remat recomputes activations in the backward pass: the same parameters (to float
    rounding) after 5 steps with dropout on (its masks replayed, not redrawn), under FSDP x TP."""
    policies = ("full", "dots_saveable") if STRESS else ("full",)
    results = {}
    for remat in ("none", *policies):
        cfg = dataclasses.replace(TINY, hidden_dropout=0.1, remat=remat)
        trainer = bert_trainer(
            (1, 4, 2),
            optax.sgd(0.5, momentum=0.9),
            config=TrainerConfig(epochs=1, stop_at_step=5),
            model=lambda cfg=cfg: BertForMaskedLM(cfg, rngs=nnx.Rngs(params=0, dropout=1)),
        )
        results[remat] = params_of(trainer.fit(data).state)
    for remat in policies:
        # Not bit-identical: XLA fuses the recomputed forward pass differently (measured 2.8e-7,
        # the rounding of DP on 4 vs 8 devices). A redrawn dropout mask would be ~1e-1.
        assert relative_l2(results[remat], results["none"]) < 1e-5
    with pytest.raises(ValueError, match="remat='dots' is not one of none, full, dots_saveable"):
        dataclasses.replace(TINY, remat="dots")


# --------------------------------------------------------------------------- scanned layers


def test_scanned_layers_compute_what_the_unrolled_ones_do(data):
    """model.scan_layers stacks the layers' parameters on a leading 'layers' axis: with the
    unrolled model's values copied in, the same logits and gradients; and it trains under
    FSDP x TP (the 'layers' axis is replicated, the rest laid out as before)."""
    cfg = dataclasses.replace(TINY, num_layers=3)
    flat = BertForMaskedLM(cfg, rngs=nnx.Rngs(0))
    scanned = BertForMaskedLM(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(0))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(layer, nnx.Param) for layer in flat.layers])
    nnx.update(scanned.layers, stacked)
    nnx.update(scanned, nnx.state(flat, nnx.Param).filter(lambda path, _: path[0] != "layers"))
    batch = {k: jnp.asarray(v) for k, v in data.take(np.arange(4)).items()}
    grads = {}
    for name, model in (("flat", flat), ("scanned", scanned)):
        loss = lambda m: recipe.loss_fn(m, batch)[0].mean()  # noqa: E731
        grads[name] = nnx.jit(nnx.value_and_grad(loss))(model)
    assert grads["scanned"][0] == pytest.approx(float(grads["flat"][0]), rel=1e-6)
    g_flat = grads["flat"][1]["layers"][1]["intermediate"]["kernel"][...]
    g_scan = grads["scanned"][1]["layers"]["intermediate"]["kernel"][...][1]
    np.testing.assert_allclose(g_scan, g_flat, rtol=1e-5, atol=1e-7)
    trainer = bert_trainer(
        (1, 4, 2),
        optax.sgd(0.1),
        config=TrainerConfig(epochs=1, stop_at_step=2),
        model=lambda: BertForMaskedLM(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(0)),
    )
    kernel = trainer.state.params["layers"]["intermediate"]["kernel"][...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    if STRESS:  # about 8 s more: the scanned step compiled and run under FSDP x TP
        assert np.isfinite(trainer.fit(data).history[-1]["loss"])
