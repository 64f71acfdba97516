"""BERT (Devlin et al. 2019) for masked-LM pretraining, in Flax NNX.

The same computation as Hugging Face's ``BertForMaskedLM`` (post-LayerNorm encoder, exact
GELU, LayerNorm eps 1e-12, an MLM head tied to the word embeddings), so weights move both
ways (:mod:`xlafit.hf.bert`) and logits agree to float rounding (tested to 1e-4).
Two differences in layout, not in math: query, key and value are one matmul with a
``(3, hidden, hidden)`` kernel (one kernel launch instead of three, split by head under
tensor parallelism), and the MLM head can run only at the
``max_predictions`` masked positions of each sequence, as original BERT does, instead of
at every position.

Example:
    >>> from flax import nnx
    >>> cfg = BertConfig.preset("tiny", vocab_size=1000)
    >>> model = BertForMaskedLM(cfg, rngs=nnx.Rngs(0))
    >>> ids = jnp.ones((2, 16), jnp.int32)
    >>> model(ids, jnp.ones_like(ids), jnp.zeros_like(ids)).shape
    (2, 16, 1000)
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlafit.models.activations import gelu
from xlafit.parallel.sharding import constrain, logical

# Sizes of Google's BERT releases: the 24 "BERT miniatures" (Turc et al. 2019) name
# tiny/mini/small/medium; base and large are the paper's.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"num_layers": 2, "hidden_size": 128, "num_heads": 2, "intermediate_size": 512},
    "mini": {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "intermediate_size": 1024},
    "small": {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "intermediate_size": 2048},
    "medium": {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "intermediate_size": 2048},
    "base": {"num_layers": 12, "hidden_size": 768, "num_heads": 12, "intermediate_size": 3072},
    "large": {"num_layers": 24, "hidden_size": 1024, "num_heads": 16, "intermediate_size": 4096},
}


# model.remat values: none, full, and the policies of jax.checkpoint_policies that need no arguments.
REMAT_POLICIES = (
    "none",
    "full",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots",
    "checkpoint_dots_with_no_batch_dims",
    "nothing_saveable",
    "everything_saveable",
)


def remat_policy(name: str) -> Any:
    """The ``jax.checkpoint`` policy of a ``remat`` name (None: save nothing, ``"full"``)."""
    return None if name in ("none", "full") else getattr(jax.checkpoint_policies, name)


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Sizes and options of a BERT; :meth:`preset` fills the sizes by name.

    ``dtype`` is the compute dtype (``"bfloat16"`` for mixed precision); parameters are
    always float32. ``attention`` picks the kernel of ``jax.nn.dot_product_attention``:
    ``"xla"`` everywhere, ``"cudnn"`` (flash attention, GPUs, bf16/fp16 only, right-padded
    sequences), or ``"auto"`` (cuDNN where it applies, else XLA).
    """

    vocab_size: int = 30522
    num_layers: int = 12
    hidden_size: int = 768
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    dropout_bits: Literal[16, 32] = 16  # random bits per hidden-dropout decision (see Dropout)
    # Rematerialisation of each encoder layer in the backward pass: "none" keeps every
    # activation; "full" keeps only each layer's input and recomputes the rest (about one
    # more forward pass, activations of one layer live instead of all); or a policy of
    # jax.checkpoint_policies that keeps some ("dots_saveable": the matmul outputs).
    remat: str = "none"
    # One encoder layer compiled instead of num_layers: the layers' parameters are stacked on
    # a leading "layers" axis and the encoder is an nnx.scan over them. Another parameter
    # structure: checkpoints do not move between scanned and unrolled models.
    scan_layers: bool = False

    def __post_init__(self) -> None:
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r} is not one of {', '.join(REMAT_POLICIES)}.")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1).")
        if self.dropout_bits not in (16, 32):
            raise ValueError(f"dropout_bits={self.dropout_bits} must be 16 or 32.")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads} "
                f"(each head gets hidden_size / num_heads dimensions)."
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> BertConfig:
        """A named size (tiny, mini, small, medium, base, large) with ``overrides`` applied.

        Example:
            >>> BertConfig.preset("mini", vocab_size=8000).hidden_size
            256
        """
        if name not in PRESETS:
            raise ValueError(f"unknown BERT preset {name!r}; choose one of {', '.join(PRESETS)} or 'custom'.")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.bfloat16 if self.dtype == "bfloat16" else jnp.float32

    def train_flops_per_sequence(self, seq_len: int, predictions: int | None = None) -> float:
        """Model FLOPs (2 per multiply-add, backward = 2x forward) to train on one sequence.

        Counts every matmul: the encoder's dense layers, attention scores and their
        weighting (``2 * seq_len * hidden`` each per token and layer), and the MLM head at
        ``predictions`` positions (every position when None). Embedding lookups, LayerNorm,
        softmax and GELU are not matmuls and are left out, as in the PaLM paper's MFU
        (Chowdhery et al. 2022, appendix B).
        """
        h, i, n = self.hidden_size, self.intermediate_size, self.num_layers
        dense_per_token = n * (4 * h * h + 2 * h * i)
        attention_per_token = n * 2 * seq_len * h
        head_per_prediction = h * h + h * self.vocab_size
        encoder = seq_len * (dense_per_token + attention_per_token)
        forward = 2 * (encoder + (predictions or seq_len) * head_per_prediction)
        return 3.0 * forward


def _dense(cfg: BertConfig, din: int, dout: int, rngs: nnx.Rngs, axes: tuple[str, str]) -> nnx.Linear:
    """A dense layer whose kernel has the logical axes ``axes`` (in, out) and whose bias has the
    out axis, except where the out axis is the model width (``embed``): a row-parallel
    layer's bias is added after the reduction, replicated (Megatron)."""
    init = nnx.initializers.truncated_normal(stddev=cfg.initializer_range)
    bias_axis = "norm" if axes[1] == "embed" else axes[1]
    return nnx.Linear(
        din,
        dout,
        kernel_init=logical(init, *axes),
        bias_init=logical(nnx.initializers.zeros_init(), bias_axis),
        dtype=cfg.compute_dtype,
        rngs=rngs,
    )


class QKV(nnx.Module):
    """Query, key and value projections as one matmul: ``x (B, T, hidden) -> (B, T, 3, hidden)``.

    The kernel is ``(3, hidden, hidden)``: ``kernel[0]`` is the query's ``(in, out)`` matrix,
    with logical axes ``(-, embed, heads)``. Its output columns are head after head, so a
    split of them over ``tensor`` gives each device whole heads (Megatron: each device of a
    tensor group holds and computes its own heads' q, k and v), and FSDP splits ``embed``.
    The two minor dimensions stay ``hidden`` wide (a TPU pads a minor dimension of 64, a
    head's width, to 128). The initial values are those of a ``(hidden, 3 * hidden)``
    ``[q|k|v]`` matrix, and checkpoints written in that older layout still restore
    (:data:`xlafit.saveable.RESHAPED`).
    """

    def __init__(self, cfg: BertConfig, rngs: nnx.Rngs) -> None:
        h = cfg.hidden_size
        normal = nnx.initializers.truncated_normal(stddev=cfg.initializer_range)

        def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
            return qkv_from_matrix(normal(key, (h, 3 * h), dtype))  # the values of the [q|k|v] matrix

        self.kernel = nnx.Param(logical(init, None, "embed", "heads")(rngs.params(), (3, h, h)))
        self.bias = nnx.Param(logical(nnx.initializers.zeros_init(), None, "heads")(rngs.params(), (3, h)))
        self.dtype = cfg.compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x, kernel, bias = nnx.nn.dtypes.promote_dtype((x, self.kernel[...], self.bias[...]), dtype=self.dtype)
        return jnp.einsum("bth,khd->btkd", x, kernel) + bias[None, None]


def qkv_from_matrix(matrix: Any) -> Any:
    """``(..., hidden, 3 * hidden)`` ``[q|k|v]`` columns -> ``(..., 3, hidden, hidden)`` (NumPy or JAX)."""
    *lead, h, _ = matrix.shape
    return matrix.reshape(*lead, h, 3, h).swapaxes(-3, -2)


def _layer_norm(cfg: BertConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # Statistics are computed in float32 even for bf16 inputs (Flax upcasts them).
    return nnx.LayerNorm(
        cfg.hidden_size,
        epsilon=cfg.layer_norm_eps,
        dtype=cfg.compute_dtype,
        scale_init=logical(nnx.initializers.ones_init(), "norm"),
        bias_init=logical(nnx.initializers.zeros_init(), "norm"),
        rngs=rngs,
    )


class Dropout(nnx.Dropout):
    """``nnx.Dropout`` drawing 16 random bits per decision instead of 32.

    JAX's counter-based generator hashes once per 32-bit word, and dropout masks are the
    bulk of a BERT step's random numbers (on an H100 their fusions were 8% of BERT-base's
    step time): one word here decides two elements. An element is kept when its 16 bits
    are >= ``round(rate * 2**16)`` and scaled by the inverse of that exact keep
    probability (rate 0.1: kept with probability 0.899994), so the layer stays unbiased.
    ``bits=32`` is ``nnx.Dropout`` itself.
    """

    def __init__(self, rate: float, *, bits: int = 16, rngs: nnx.Rngs) -> None:
        super().__init__(rate, rngs=rngs)
        self.bits = bits

    def __call__(
        self,
        inputs: jax.Array,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
    ) -> jax.Array:
        """Drops elements of ``inputs``; ``deterministic`` and ``rngs`` override the layer's, as in ``nnx.Dropout``."""
        off = self.deterministic if deterministic is None else deterministic
        if self.bits == 32 or self.rate == 0.0 or off:
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        if rngs is None:
            key = self.rngs()
        elif isinstance(rngs, nnx.Rngs):
            key = rngs[self.rng_collection]()
        elif isinstance(rngs, nnx.RngStream):
            key = rngs()
        else:
            key = rngs
        *lead, last = inputs.shape
        half = -(-last // 2)
        words = jax.random.bits(key, (*lead, half), jnp.uint32)
        bits = jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(*lead, 2 * half)[..., :last]
        dropped = round(self.rate * 2**16)
        scale = jnp.asarray(2**16 / (2**16 - dropped), inputs.dtype)
        return jnp.where(bits >= dropped, inputs * scale, jnp.zeros_like(inputs))


class BertEmbeddings(nnx.Module):
    def __init__(self, cfg: BertConfig, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.truncated_normal(stddev=cfg.initializer_range)

        def embed(rows: int, axis: str) -> nnx.Embed:
            return nnx.Embed(
                rows, cfg.hidden_size, embedding_init=logical(init, axis, "embed"), dtype=cfg.compute_dtype, rngs=rngs
            )

        self.word = embed(cfg.vocab_size, "vocab")
        self.position = embed(cfg.max_position_embeddings, "positions")
        self.token_type = embed(cfg.type_vocab_size, "types")
        self.norm = _layer_norm(cfg, rngs)
        self.dropout = Dropout(cfg.hidden_dropout, bits=cfg.dropout_bits, rngs=rngs)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array, position_ids: jax.Array | None) -> jax.Array:
        dtype = self.word.dtype or jnp.float32
        # The gradient of a lookup is a scatter-add. It runs on the float32 table (GPUs add
        # float32 atomically; bfloat16 they emulate); position and token-type tables are
        # tiny, so B*T updates would land on a few rows and serialise (measured on an H100:
        # the step took 2.1x longer). A slice and a one-hot matmul have dense gradients.
        x = jnp.take(self.word.embedding[...], input_ids, axis=0).astype(dtype)  # (B, T, h)
        if position_ids is None:
            x = x + self.position.embedding[: input_ids.shape[1]].astype(x.dtype)[None]
        else:
            x = x + self.position(position_ids)
        types = jax.nn.one_hot(token_type_ids, self.token_type.num_embeddings, dtype=x.dtype)
        x = x + types @ self.token_type.embedding[...].astype(x.dtype)
        return self.dropout(self.norm(x))


class BertAttention(nnx.Module):
    def __init__(self, cfg: BertConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        # Megatron: q, k and v column-parallel by head, the output projection row-parallel.
        self.qkv = QKV(cfg, rngs)
        self.out = _dense(cfg, cfg.hidden_size, cfg.hidden_size, rngs, ("heads", "embed"))
        self.attention_dropout = nnx.Dropout(cfg.attention_dropout, rngs=rngs)
        self.dropout = Dropout(cfg.hidden_dropout, bits=cfg.dropout_bits, rngs=rngs)
        self.norm = _layer_norm(cfg, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, kv_lengths: jax.Array | None) -> jax.Array:
        b, t, h = x.shape
        heads = self.cfg.num_heads
        qkv = self.qkv(x).reshape(b, t, 3, heads, h // heads)
        qkv = constrain(qkv, "batch", None, None, "heads", None)  # each device of a tensor group: its own heads
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.cfg.attention_dropout > 0 and not self.attention_dropout.deterministic:
            # Dropout on the attention probabilities needs them materialised: the plain path.
            scores = jnp.einsum("btnd,bsnd->bnts", q, k) / jnp.sqrt(h // heads).astype(q.dtype)
            scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
            probs = self.attention_dropout(jax.nn.softmax(scores, axis=-1)).astype(v.dtype)
            context = jnp.einsum("bnts,bsnd->btnd", probs, v)
        elif kv_lengths is not None:  # cuDNN flash attention: right padding given as lengths
            context = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths, implementation="cudnn")
        else:
            context = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
        x = x + self.dropout(self.out(context.reshape(b, t, h)))
        return self.norm(x)


class BertLayer(nnx.Module):
    def __init__(self, cfg: BertConfig, rngs: nnx.Rngs) -> None:
        self.attention = BertAttention(cfg, rngs)
        # Megatron's MLP: column-parallel in, row-parallel out (one all-reduce per MLP).
        self.intermediate = _dense(cfg, cfg.hidden_size, cfg.intermediate_size, rngs, ("embed", "mlp"))
        self.output = _dense(cfg, cfg.intermediate_size, cfg.hidden_size, rngs, ("mlp", "embed"))
        self.dropout = Dropout(cfg.hidden_dropout, bits=cfg.dropout_bits, rngs=rngs)
        self.norm = _layer_norm(cfg, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, kv_lengths: jax.Array | None) -> jax.Array:
        x = self.attention(x, mask, kv_lengths)
        y = constrain(gelu(self.intermediate(x)), "batch", None, "mlp")  # (B, T, 4h), split over tensor
        return constrain(self.norm(x + self.dropout(self.output(y))), "batch", None, None)


def _stacked_layers(cfg: BertConfig, rngs: nnx.Rngs) -> BertLayer:
    """``num_layers`` BERT layers as one module whose variables have a leading ``layers`` axis
    (each layer drawn from its own split of the keys), for :func:`nnx.scan`."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(rngs: nnx.Rngs) -> BertLayer:
        return BertLayer(cfg, rngs)

    return build(rngs)


def _run_layer(layer: BertLayer, x: jax.Array, mask: jax.Array, kv_lengths: jax.Array | None) -> jax.Array:
    return layer(x, mask, kv_lengths)


def _right_padded(attention_mask: jax.Array) -> bool:
    """False when ``attention_mask`` is concrete and some row has a 0 before a 1."""
    if isinstance(attention_mask, jax.core.Tracer):
        return True  # traced: unknown here; xlafit's batches are right-padded
    mask = np.asarray(attention_mask).astype(bool)
    return bool((mask == np.cumprod(mask, axis=-1).astype(bool)).all())


class BertForMaskedLM(nnx.Module):
    """BERT encoder with the masked-LM head; Hugging Face's ``BertForMaskedLM`` in NNX.

    A new model is in eval mode (dropout off), as ``from_pretrained`` gives in
    ``transformers``: calling it twice gives the same logits. ``model.train()`` turns
    dropout on; xlafit's ``Trainer`` does that itself.

    Args:
        cfg: sizes and options.
        rngs: ``params`` for initialisation (BERT's truncated normal, std 0.02) and
            ``dropout``.
    """

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg, rngs)
        # With scan_layers, one BertLayer whose variables are stacked (typed as the list it replaces).
        self.layers: nnx.List[BertLayer] = (
            typing.cast(Any, _stacked_layers(cfg, rngs))
            if cfg.scan_layers
            else nnx.List([BertLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        )
        self.head_dense = _dense(cfg, cfg.hidden_size, cfg.hidden_size, rngs, ("embed", "embed"))
        self.head_norm = _layer_norm(cfg, rngs)
        self.head_bias = nnx.Param(
            jnp.zeros((cfg.vocab_size,), jnp.float32), out_sharding=("vocab",), eager_sharding=False
        )
        self.eval()

    def encode(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        position_ids: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Hidden states ``[B, T, hidden]``.

        ``segment_ids`` (packed sequences: 1, 1, 2, 2, 2, 0 for padding) keep attention
        inside each segment; give ``position_ids`` that restart at every segment then.
        """
        b, t = input_ids.shape
        if t > self.cfg.max_position_embeddings:
            raise ValueError(
                f"sequences of {t} tokens are longer than max_position_embeddings="
                f"{self.cfg.max_position_embeddings}; shorten them or build a model with more positions."
            )
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), jnp.int32)
        if token_type_ids is None:
            token_type_ids = jnp.zeros((b, t), jnp.int32)
        valid = attention_mask.astype(bool)
        # (B, 1, 1|T, T): which keys each query may see. Padding queries still attend (to
        # the valid keys), as in Hugging Face, so every position has finite logits.
        mask = valid[:, None, None, :]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
        kv_lengths = None
        if self._use_cudnn(segment_ids, attention_mask):
            kv_lengths = attention_mask.astype(jnp.int32).sum(-1)
        x = constrain(self.embeddings(input_ids, token_type_ids, position_ids), "batch", None, None)
        run = _run_layer
        if self.cfg.remat != "none":
            run = nnx.remat(_run_layer, policy=remat_policy(self.cfg.remat))
        if self.cfg.scan_layers:

            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def encoder(layer: BertLayer, x: jax.Array) -> jax.Array:
                return run(layer, x, mask, kv_lengths)

            return encoder(typing.cast(BertLayer, self.layers), x)
        for layer in self.layers:
            x = run(layer, x, mask, kv_lengths)
        return x

    def _use_cudnn(self, segment_ids: jax.Array | None, attention_mask: jax.Array) -> bool:
        """cuDNN flash attention takes padding as lengths: right padding only. xlafit's data
        is right-padded; a mask known here (not traced) that is not falls back to XLA."""
        if self.cfg.attention == "xla" or (self.cfg.attention == "auto" and jax.default_backend() != "gpu"):
            return False
        fits = segment_ids is None and self.cfg.dtype == "bfloat16" and _right_padded(attention_mask)
        if self.cfg.attention == "cudnn" and not fits:
            raise ValueError(
                "attention='cudnn' needs dtype='bfloat16', no segment_ids and right-padded attention masks; "
                "use 'xla' or 'auto'."
            )
        return fits

    def mlm_logits(self, hidden: jax.Array) -> jax.Array:
        """The MLM head on hidden states ``[..., hidden]`` -> float32 logits ``[..., vocab]``."""
        x = self.head_norm(gelu(self.head_dense(hidden)))
        # Tied decoder: the word embedding matrix, transposed (HF's tie_word_embeddings).
        logits = self.embeddings.word.attend(x)
        bias = self.head_bias[...].reshape((1,) * (logits.ndim - 1) + (-1,))
        return logits.astype(jnp.float32) + bias

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        *,
        position_ids: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        masked_positions: jax.Array | None = None,
    ) -> jax.Array:
        """MLM logits ``[B, T, vocab]``, or ``[B, P, vocab]`` at ``masked_positions [B, P]``.

        Args:
            input_ids: token ids ``[B, T]`` (int).
            attention_mask: 1 for tokens, 0 for padding ``[B, T]``; default all ones.
            token_type_ids: sentence A (0) or B (1) ``[B, T]``; default zeros.
            position_ids, segment_ids: for packed sequences (see :meth:`encode`).
            masked_positions: run the head only at these positions (original BERT's
                ``gather_indexes``): the vocabulary projection is the largest matmul of a
                small BERT, and only the masked positions have labels.
        """
        hidden = self.encode(input_ids, attention_mask, token_type_ids, position_ids, segment_ids)
        if masked_positions is not None:
            hidden = jnp.take_along_axis(hidden, masked_positions[..., None].astype(jnp.int32), axis=1)
        return self.mlm_logits(hidden)
