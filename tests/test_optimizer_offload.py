"""``trainer.optimizer_offload``: the optimizer state in the host's pinned memory between
steps. On the CPU (whose devices address a pinned host memory too) the run is the same bit
for bit, and a checkpoint of it restores exactly; on the TPU compiler the state a core holds
in HBM drops by the moments, whose copies the step model prices over the host link."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from helpers import SMALL_LLM
from xlafit.check.recipes import recipe_program
from xlafit.check.tpu import Steps, memory_of, no_persistent_cache
from xlafit.config import TrainerConfig
from xlafit.errors import ConfigError
from xlafit.platform import hardware as tpu
from xlafit.predict.ops import kernels
from xlafit.recipes import load_config


class _Mlp(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.a, self.b = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


def _loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


DATA = {
    "x": np.random.default_rng(0).normal(size=(128, 8)).astype(np.float32),
    "y": np.random.default_rng(1).integers(0, 4, 128).astype(np.int32),
}


def _fit(strategy, offload, run_dir=None, stop_at_step=None):
    trainer = xlafit.Trainer(
        _Mlp(),
        _loss,
        optax.adamw(1e-2),
        strategy=strategy,
        global_batch=32,
        config=TrainerConfig(
            epochs=2, stop_at_step=stop_at_step, log_every_steps=1, optimizer_offload=offload, steps_per_call=2
        ),
        run_dir=run_dir,
    )
    result = trainer.fit(DATA, eval=DATA)  # the eval step takes the state as it lies too
    trainer.close()
    return result


def _kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def test_on_the_cpu_the_state_on_the_host_trains_the_same_bits_and_resumes_exactly(strategy1, tmp_path):
    on_device = _fit(strategy1, False)
    whole = _fit(strategy1, True)
    assert _kinds(whole.state.opt_state) == {"pinned_host"} and _kinds(whole.state.params) == {"device"}
    assert [r["loss"] for r in whole.history] == [r["loss"] for r in on_device.history]
    assert whole.eval == on_device.eval
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(on_device.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Stopped at step 3 with a checkpoint (Orbax saves the state from host memory), resumed
    # into host memory, it ends where the uninterrupted run does.
    assert int(_fit(strategy1, True, tmp_path, stop_at_step=3).state.step) == 3
    resumed = _fit(strategy1, True, tmp_path)
    assert int(resumed.state.step) == 8 and _kinds(resumed.state.opt_state) == {"pinned_host"}
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_lora_run_is_refused_the_setting_in_one_line():
    with pytest.raises(ConfigError, match=r"with lora.rank=8 it is the adapters' own.*trainer.optimizer_offload=false"):
        load_config("llm", ["lora.rank=8", "trainer.optimizer_offload=true"])


def test_on_the_tpu_compiler_the_moments_leave_the_cores_hbm_and_cross_the_host_link_each_step():
    """A one-layer Llama's full fine-tune compiled for a v5e core (about 6 s each)."""
    v5e = tpu.parse_target("v5e-1")
    found = {}
    for offload in ("false", "true"):
        program, _, _ = recipe_program("llm", [*SMALL_LLM, f"trainer.optimizer_offload={offload}"])
        steps = Steps(v5e, program)
        with no_persistent_cache():  # the compile-only client cannot read an entry back
            compiled, _ = steps.compile_train(1)
        found[offload] = steps, memory_of(compiled, steps.state_bytes, 0), compiled.as_text()
    (_, before, _), (on_host, after, hlo) = found["false"], found["true"]
    moments = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(on_host.state.opt_state))
    assert moments > 2 * 66e6  # Adam's two float32 moments of 16.6M parameters (the embedding's most)
    assert before["state"] - after["state"] == moments and _kinds(on_host.state.opt_state) == {"pinned_host"}
    assert before["arguments"] - after["arguments"] >= moments  # the compiler's own count of HBM
    # The compiler counts the host's memory apart, and in its peak: taken out of the HBM's.
    assert "host memory" not in before and after["host memory"] >= moments
    assert after["peak"] + after["host memory"] == compiled.memory_analysis().peak_memory_in_bytes
    # Each step copies the moments in and back over the host link: priced as "host" kernels.
    host = [k for k in kernels(hlo) if k.kind == "host"]
    assert sum(k.bytes for k in host if "from host" in k.target) >= moments - 8  # the two counts: scalars
    assert sum(k.bytes for k in host if "to host" in k.target) >= moments - 8
