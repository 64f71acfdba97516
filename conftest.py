"""Settings for the tests and the docstring examples: 8 simulated CPU devices and strict
JAX numerics, set before JAX starts."""

import os

# The suite's programs are tiny and each runs a few steps: compiling them is most of its time.
# XLA:CPU's LLVM backend without optimisation compiles them about 15 % faster (the TPU compiler
# ignores the flag). Subprocesses that run the CLI as a user would drop XLA_FLAGS.
SUITE_XLA_FLAGS = ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"]
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *SUITE_XLA_FLAGS])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# gcsfs picks its GCS client class when it is first imported: with this unset, the experimental
# one, whose gRPC probe of the local GCS server (tests/conftest.py) fails its TLS handshake and
# retries for minutes on each call. The `gcs` fixture sets it too, but a test that imports gcsfs
# earlier in the same worker would already have made the choice.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import jax  # noqa: E402

from xlafit.parallel.cluster import configure  # noqa: E402
from xlafit.platform.cpu import CpuConfig  # noqa: E402

# The same XLA:CPU flags as every xlafit run, whichever test happens to start JAX first. The
# suite's one process compiles hundreds of programs: it returns their freed memory to the OS
# (tests/test_host_memory.py covers cpu.keep_memory, in processes of its own).
configure(cpu=CpuConfig(keep_memory=False))

# Implicit rank promotion hides shape bugs (a [B] loss broadcast against [B, 1]).
jax.config.update("jax_numpy_rank_promotion", "raise")
# Not jax_numpy_dtype_promotion="strict": optax 0.2.8's Adam bias correction mixes a Python
# float with an int32 step and fails under it.
