"""A model or train state larger than the memory the machine has free is refused before it
is made, in one line with the fix: on a CPU it would get the process killed for memory (a
notebook's kernel dies) after minutes of loading, with no word of why."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import xlafit
from xlafit.check import check_recipe
from xlafit.errors import ConfigError
from xlafit.platform.host_memory import available_bytes, state_bytes

pytestmark = pytest.mark.skipif(available_bytes() is None, reason="the kernel does not say how much memory is free")


def test_a_train_state_beyond_the_free_memory_is_refused_before_it_is_made(strategy8):
    """The walk: `xlafit train llm model.preset=llama-3.1-8b` on a CPU was killed by the kernel."""

    def build():  # 100,000 x 100,000 float32: 40 GB of parameters, twice that of Adam's moments
        return nnx.Linear(100_000, 100_000, rngs=nnx.Rngs(0))

    def loss_fn(model, batch):
        return jnp.mean(model(batch["x"]) ** 2, axis=-1), {}

    with pytest.raises(ConfigError, match=r"^the train state .* takes \d+\.\d GiB, more than the \d+\.\d GiB of"):
        xlafit.Trainer(build, loss_fn, optax.adam(1e-3), strategy=strategy8, global_batch=8)


def test_a_model_beyond_the_free_memory_is_refused_by_check_and_named():
    """The walk: `xlafit check llm model.preset=qwen3.5-9b lora.rank=16` (no --tpu) was killed
    while it made the model; a 27B one is more than any CI machine holds."""
    with pytest.raises(ConfigError) as e:
        check_recipe("llm", ["model.preset=qwen3.5-27b", "lora.rank=16", "data.seq_len=128"])
    message = str(e.value)
    assert message.startswith("model.preset=qwen3.5-27b (26.90B parameters in float32) takes 100.2 GiB"), message
    assert "xlafit check llm --tpu colab,kaggle" in message and "lora.base_dtype=nf4" in message


def test_a_replicated_leaf_counts_once_per_device_that_holds_it(strategy8):
    mesh = strategy8.mesh
    leaf = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    split = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, PartitionSpec(mesh.axis_names[0])))
    assert state_bytes({"replicated": leaf}) == 8 * 128
    assert state_bytes({"split": split}) == 128
