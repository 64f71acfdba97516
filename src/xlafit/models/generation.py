"""Text generation with a key/value cache: a batch of prompts, greedy or sampled.

The prompts are left-padded to one length and run through the model once (the prefill),
filling a cache of ``prompt + max_new_tokens`` slots; then each new token costs one step of
the model over one position (:meth:`xlafit.models.llama.LlamaForCausalLM.cached`), the whole
loop one compiled program (``lax.scan``). Each row's positions start at 0 at its first real
token and its padding is never attended to, so a row generates what it would alone.

Sampling follows the usual order: logits over ``temperature``, then the ``top_k`` largest,
then the smallest set whose probabilities add up to ``top_p``; ``temperature=0`` is greedy
(the largest logit, ties to the smallest id, as ``argmax``). A row stops at its first
end-of-sequence token (the tokens after it are dropped).

Example:
    >>> import jax.numpy as jnp
    >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    >>> kept = filter_logits(logits, top_k=2, top_p=1.0) > -jnp.inf
    >>> kept.tolist()
    [[True, True, False, False]]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlafit.errors import ConfigError
from xlafit.models.llama import LlamaForCausalLM

__all__ = ["Sampling", "filter_logits", "generate"]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: ``temperature`` 0 is greedy; ``top_k`` 0 and
    ``top_p`` 1 leave the distribution whole."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}: give temperature >= 0 "
                "(0: greedy), top_k >= 0 (0: all) and 0 < top_p <= 1."
            )


def filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """``logits [B, V]`` with everything outside the ``top_k`` largest and outside the
    smallest set reaching probability ``top_p`` set to -inf (the most likely token stays).
    A ``top_k`` above the vocabulary keeps every token, as in ``transformers``."""
    top_k = min(top_k, logits.shape[-1])
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1)
        # The smallest logit still inside: the first whose cumulative probability reaches top_p.
        cut = jnp.argmax(cumulative >= top_p, axis=-1)
        threshold = jnp.take_along_axis(ordered, cut[:, None], axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def _choose(logits: jax.Array, sampling: Sampling, key: jax.Array) -> jax.Array:
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "sampling"))
def _run(
    graphdef: Any, state: Any, ids: jax.Array, pads: jax.Array, max_new_tokens: int, sampling: Sampling
) -> jax.Array:
    """The prefill and ``max_new_tokens`` steps, compiled as one program: new tokens ``[B, N]``."""
    model = nnx.merge(graphdef, state)
    b, p = ids.shape
    slots = p + max_new_tokens
    visible = jnp.arange(slots)[None, :] >= pads[:, None]  # (B, S): a row's padding is never a key
    positions = jnp.maximum(jnp.arange(p)[None, :] - pads[:, None], 0)
    cache = model.empty_cache(b, slots)
    logits, cache = model.cached(ids, positions, cache, jnp.int32(0), visible)
    keys = jax.random.split(jax.random.key(sampling.seed), max_new_tokens)
    first = _choose(logits[:, -1], sampling, keys[0])

    def step(carry: tuple[jax.Array, Any, Any], i: jax.Array) -> tuple[tuple[jax.Array, Any, Any], jax.Array]:
        token, cache, weights = carry
        slot = p + i
        position = (slot - pads)[:, None]
        # The weights ride in the carry, merged inside the loop: a module made outside a
        # lax.scan cannot enter the nnx.scan over scanned layers inside it.
        logits, cache = nnx.merge(graphdef, weights).cached(token[:, None], position, cache, slot, visible)
        following = _choose(logits[:, -1], sampling, keys[i + 1])
        return (following, cache, weights), token

    if max_new_tokens == 1:
        return first[:, None]
    (last, _, _), tokens = jax.lax.scan(step, (first, cache, state), jnp.arange(max_new_tokens - 1))
    return jnp.concatenate([tokens.T, last[:, None]], axis=1)


def generate(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eos_ids: Sequence[int] = (),
    pad_id: int = 0,
) -> list[list[int]]:
    """The tokens each prompt continues with: at most ``max_new_tokens``, cut after the first
    of ``eos_ids`` (which is kept).

    Args:
        model: the model, on whatever devices its state is (sharded state stays sharded).
        prompts: token ids per prompt (a batch of any lengths, each at least one token).
        max_new_tokens: the tokens generated per prompt (one compiled program per prompt
            length, batch and this number).
        sampling: greedy by default.
        eos_ids: the tokens that end a sequence (a chat model's end of turn too).
        pad_id: the id that pads short prompts (never attended to).

    Raises:
        ConfigError: the longest prompt and ``max_new_tokens`` do not fit the model's
            ``max_position_embeddings``.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: generate at least one token")
    length = max(len(p) for p in prompts)
    # Past the context the positions have no trained embedding, and the cache of length +
    # max_new_tokens slots is allocated up front: refused rather than run (or hung) on.
    context = model.cfg.max_position_embeddings
    if length + max_new_tokens > context:
        fix = f"give max_new_tokens={context - length} or fewer" if length < context else "shorten the prompt"
        raise ConfigError(
            f"the longest prompt's {length} tokens + max_new_tokens={max_new_tokens} = {length + max_new_tokens} is "
            f"more than the model's context (max_position_embeddings={context}); {fix}."
        )
    ids = np.full((len(prompts), length), pad_id, np.int32)
    pads = np.array([length - len(p) for p in prompts], np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = prompt
    graphdef, state = nnx.split(model)
    tokens = np.asarray(
        _run(graphdef, state, jnp.asarray(ids), jnp.asarray(pads), max_new_tokens, sampling or Sampling())
    )
    out = []
    stop = set(eos_ids)
    for row in tokens.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        out.append(row[:end])
    return out
