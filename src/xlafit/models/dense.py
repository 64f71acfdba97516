"""The decoder families' dense layer (bias-free unless asked, its kernel named by logical
axes) and their gated MLP, which a decoder layer and a mixture of experts' shared expert
(:mod:`xlafit.models.moe`) both use.

Example:
    >>> from flax import nnx
    >>> from xlafit.models.llama_config import LlamaConfig
    >>> layer = dense(LlamaConfig.preset("tiny"), 64, 32, nnx.Rngs(0), ("embed", "heads"), False)
    >>> layer.kernel.shape
    (64, 32)
"""

from __future__ import annotations

import jax
from flax import nnx

from xlafit.models.activations import gated
from xlafit.models.llama_config import DTYPES, LlamaConfig
from xlafit.parallel.sharding import constrain, logical

__all__ = ["LlamaMLP", "dense"]


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


class LlamaMLP(nnx.Module):
    """A gated MLP: ``down(act(gate(x)) * up(x))`` with SiLU (SwiGLU, Shazeer 2020) or tanh
    GELU (GeGLU, Gemma); Megatron's column/row split. ``width``: the inner size (default the
    config's ``intermediate_size``)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, width: int | None = None) -> None:
        h, i = cfg.hidden_size, width or cfg.intermediate_size
        self.gate_proj = dense(cfg, h, i, rngs, ("embed", "mlp"), False)
        self.up_proj = dense(cfg, h, i, rngs, ("embed", "mlp"), False)
        self.down_proj = dense(cfg, i, h, rngs, ("mlp", "embed"), False)
        self.gelu = cfg.hidden_activation == "gelu_tanh"

    def __call__(self, x: jax.Array) -> jax.Array:
        gated_product = gated(self.gate_proj(x), self.up_proj(x), "gelu_tanh" if self.gelu else "silu")
        y = constrain(gated_product, "batch", None, "mlp")  # (B, T, i)
        return self.down_proj(y)
