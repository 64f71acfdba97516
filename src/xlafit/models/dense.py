"""The decoder families' dense layer: bias-free unless asked, its kernel named by logical axes.

Example:
    >>> from flax import nnx
    >>> from xlafit.models.llama_config import LlamaConfig
    >>> layer = dense(LlamaConfig.preset("tiny"), 64, 32, nnx.Rngs(0), ("embed", "heads"), False)
    >>> layer.kernel.shape
    (64, 32)
"""

from __future__ import annotations

from flax import nnx

from xlafit.models.llama_config import DTYPES, LlamaConfig
from xlafit.parallel.sharding import logical

__all__ = ["dense"]


def dense(
    cfg: LlamaConfig, din: int, dout: int, rngs: nnx.Rngs, axes: tuple[str | None, str | None], bias: bool
) -> nnx.Linear:
    """A bias-free (unless ``bias``) dense layer whose kernel has the logical axes ``axes``
    (normal initialisation, std ``initializer_range``, as Hugging Face)."""
    init = nnx.initializers.normal(stddev=cfg.initializer_range)
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        kernel_init=logical(init, *axes),
        bias_init=logical(nnx.initializers.zeros_init(), axes[1]),
        dtype=cfg.compute_dtype,
        param_dtype=DTYPES[cfg.param_dtype],
        rngs=rngs,
    )
