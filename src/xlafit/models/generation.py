"""Text generation with a key/value cache: a batch of prompts, greedy or sampled.

The prompts are left-padded to one length and run through the model once (the prefill),
filling a cache of ``prompt + max_new_tokens`` slots; then each new token costs one step of
the model over one position (:meth:`xlafit.models.llama.LlamaForCausalLM.cached`), the whole
loop one compiled program (``lax.scan``). Each row's positions start at 0 at its first real
token and its padding is never attended to, so a row generates what it would alone.

Sampling follows the usual order: a ``repetition_penalty`` on the logits of the tokens the row
holds already (its prompt and what it generated: a positive logit divided by it, a negative one
multiplied, as ``transformers``' ``RepetitionPenaltyLogitsProcessor``; greedy too), the logits
over ``temperature``, then the ``top_k`` largest,
then the smallest set whose probabilities add up to ``top_p``; ``temperature=0`` is greedy
(the largest logit, ties to the smallest id, as ``argmax``). A ``top_k`` or ``top_p`` without
a temperature samples at temperature 1, as ``transformers``' ``generate(do_sample=True,
top_p=...)`` does. Sampling without a seed draws a fresh one, returned with the tokens
(:attr:`Generated.seed`) so that the same answers can be asked for again.

A row stops at its first stop token (``eos_ids``: its end-of-sequence tokens, and any others
asked for), inside the compiled loop: from there on it holds the pad id, whatever the other
rows still generate. The loop keeps its fixed number of steps (a ``lax.cond`` that skipped
the model once every row has stopped would put the cache through a conditional every
step); the host cuts each row after its stop.

On a mesh (the model's state sharded or replicated over several devices) the rows are split
as the train step splits a batch: over ``data`` x ``fsdp`` (x ``expert``), each device
holding its own rows' cache and computing their tokens (copies of the first prompt fill the
batch up to a multiple of those devices, and are cut off). Rows handed to a jitted program
as host values would be laid out as XLA's propagation chooses: replicated beside replicated
weights, so that every device would generate every row.

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
import secrets
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xlafit.errors import ConfigError
from xlafit.models.llama import LlamaForCausalLM
from xlafit.parallel.sharding import decode_axes, decode_layout, row_shards, rows_layout, rows_sharding, to_host

__all__ = ["Generated", "Sampling", "filter_logits", "generate", "generation_program"]

Layout = tuple[Mesh, tuple[str, ...]] | None  # the mesh and its batch axes (rows_layout), None: one device
Split = tuple[Mesh, tuple[str, ...]] | None  # the mesh and the axes a decode step's vocabulary is split over


SEEDS = 2**32  # a seed is a uint32: jax.random.key's own range for one word


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    ``temperature`` 0 is greedy; None (the default) is greedy too, unless ``top_k`` or
    ``top_p`` asks for sampling: then it is 1.0, ``transformers``' default temperature when
    it samples. ``top_k`` 0 and ``top_p`` 1 leave the distribution whole. ``seed`` None:
    a fresh one for each call that samples (:meth:`seeded`). ``repetition_penalty`` above 1
    makes the tokens a row holds already less likely (1: none; the module docstring).
    """

    temperature: float | None = None
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        temperature = self.temperature
        if temperature is None:
            temperature = 1.0 if self.top_k or self.top_p < 1 else 0.0
            object.__setattr__(self, "temperature", temperature)  # frozen: set once, here
        if temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"temperature={temperature}, top_k={self.top_k}, top_p={self.top_p}: give temperature >= 0 "
                "(0: greedy), top_k >= 0 (0: all) and 0 < top_p <= 1."
            )
        if temperature == 0 and (self.top_k or self.top_p < 1):
            raise ValueError(
                f"temperature=0 is greedy, and top_k={self.top_k}, top_p={self.top_p} choose among the tokens to "
                "sample from: give a temperature above 0 to sample, or drop top_k and top_p for greedy."
            )
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty}: give a number above 0 (1: no penalty; above 1 makes "
                "repeated tokens less likely)."
            )
        if self.seed is not None and not 0 <= self.seed < SEEDS:
            raise ValueError(f"seed={self.seed}: give a seed from 0 to {SEEDS - 1}.")

    @property
    def samples(self) -> bool:
        """Whether the tokens are drawn (a temperature above 0), not the likeliest one."""
        return bool(self.temperature)

    def seeded(self) -> Sampling:
        """This sampling with a seed: its own, or a fresh one where it samples and has none."""
        if self.seed is not None or not self.samples:
            return self
        return dataclasses.replace(self, seed=secrets.randbelow(SEEDS))


class Generated(list[list[int]]):
    """The tokens each prompt continues with (a list, one list of ids per prompt), and the
    :attr:`seed` the sampling drew them with (None where greedy): give it as
    ``Sampling(seed=...)`` to draw the same tokens again."""

    seed: int | None = None


def filter_logits(logits: jax.Array, top_k: int, top_p: float, split: Split = None) -> jax.Array:
    """``logits [B, V]`` with everything outside the ``top_k`` largest and outside the
    smallest set reaching probability ``top_p`` set to -inf (the most likely token stays).
    A ``top_k`` above the vocabulary keeps every token, as in ``transformers``. ``split``: the
    vocabulary's split over devices (each finds its slice's ``top_k`` first; ``top_p`` sorts
    the whole rows)."""
    top_k = min(top_k, logits.shape[-1])
    if top_k:
        kth = jax.lax.top_k(_each_slice_top_k(logits, top_k, split), top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1)
        # The smallest logit still inside: the first whose cumulative probability reaches top_p.
        cut = jnp.argmax(cumulative >= top_p, axis=-1)
        threshold = jnp.take_along_axis(ordered, cut[:, None], axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def _each_slice_top_k(logits: jax.Array, k: int, split: Split) -> jax.Array:
    """``logits [B, V]``, or where the vocabulary is split, each device's ``k`` largest of
    its slice ``[B, devices x k]``: they hold the whole rows' ``k`` largest, and only they
    move between devices."""
    if split is None:
        return logits
    b, v = logits.shape
    blocks = _slices(logits, split)
    return jax.lax.top_k(blocks, min(k, v // blocks.shape[1]))[0].reshape(b, -1)


def _slices(logits: jax.Array, split: tuple[Mesh, tuple[str, ...]]) -> jax.Array:
    """``logits [B, V]`` as ``[B, devices, V / devices]``, each device's slice its own."""
    mesh, axes = split
    b, v = logits.shape
    blocks = logits.reshape(b, row_shards(split), v // row_shards(split))
    return jax.lax.with_sharding_constraint(blocks, NamedSharding(mesh, PartitionSpec(None, axes, None)))


def _choose(
    logits: jax.Array, sampling: Sampling, key: jax.Array, split: Split = None, seen: jax.Array | None = None
) -> jax.Array:
    """The next token of each row of ``logits [B, V]``: the most likely (greedy) or one drawn.
    ``split``: the mesh and axes the vocabulary lies split over (:func:`_vocab_split`);
    ``seen [B, V]``: the tokens each row holds, penalised by ``sampling.repetition_penalty``."""
    if seen is not None:
        penalty = sampling.repetition_penalty
        logits = jnp.where(seen, jnp.where(logits < 0, logits * penalty, logits / penalty), logits)
    if not sampling.samples:
        return _argmax(logits, split)
    logits = filter_logits(logits / float(sampling.temperature or 1.0), sampling.top_k, sampling.top_p, split)
    if split is None:
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
    # jax.random.categorical's own draw (the Gumbel-max trick), its argmax over the split vocabulary
    return _argmax(logits + jax.random.gumbel(key, logits.shape, logits.dtype), split)


def _vocab_split(mesh: Mesh | None, vocab: int) -> Split:
    """Where :func:`~xlafit.parallel.sharding.decode_layout` splits a vocabulary of ``vocab``
    tokens: its mesh and axes, or None (not split)."""
    axes = decode_axes(mesh)
    if mesh is None or axes is None or vocab % row_shards((mesh, axes)):
        return None
    return mesh, axes


def _whole_rows(hidden: jax.Array, split: Split) -> jax.Array:
    """``hidden [B, ...]`` on every device of ``split`` (one gather of the rows' final hidden
    states) ahead of the output layer whose vocabulary is split: each device computes every
    row's logits over its slice of the vocabulary."""
    if split is None:
        return hidden
    return jax.lax.with_sharding_constraint(hidden, NamedSharding(split[0], PartitionSpec()))


def _argmax(logits: jax.Array, split: Split) -> jax.Array:
    """``argmax(logits, axis=-1)`` (the first of equal maxima); with the vocabulary split over
    ``split``'s devices, each finds its slice's best and one small exchange picks among them,
    where XLA's own partitioning of an argmax moves whole slices of the logits between devices."""
    if split is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    blocks = _slices(logits, split)
    best, where = blocks.max(axis=-1), jnp.argmax(blocks, axis=-1)  # [B, shards]: each slice's best
    shard = jnp.argmax(best, axis=-1)  # the first slice holding the largest
    width = blocks.shape[-1]
    return (shard * width + jnp.take_along_axis(where, shard[:, None], axis=-1)[:, 0]).astype(jnp.int32)


def _split_rows(tree: Any, layout: Layout, axis: int = 0) -> Any:
    """``tree``'s arrays with their axis ``axis`` (the rows) split over ``layout``'s batch axes."""
    if layout is None:
        return tree
    mesh, axes = layout

    def one(x: jax.Array) -> jax.Array:
        spec = [None] * x.ndim
        spec[axis] = axes  # type: ignore[call-overload]
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))

    return jax.tree.map(one, tree)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "sampling", "layout"))
def _run(
    graphdef: Any,
    state: Any,
    ids: jax.Array,
    pads: jax.Array,
    stop_ids: jax.Array,
    seed: jax.Array,
    max_new_tokens: int,
    sampling: Sampling,
    pad_id: int | jax.Array = 0,
    layout: Layout = None,
) -> jax.Array:
    """The prefill and up to ``max_new_tokens`` steps, compiled as one program: new tokens
    ``[B, N]``, ``pad_id`` after a row's first stop token (one of ``stop_ids [K]``). The seed
    is an argument, not part of ``sampling``: a new seed runs the same program. ``layout``:
    the rows' split (the cache's too, so that no device holds another's rows)."""
    model = nnx.merge(graphdef, state)
    b, p = ids.shape
    slots = p + max_new_tokens
    visible = jnp.arange(slots)[None, :] >= pads[:, None]  # (B, S): a row's padding is never a key
    positions = jnp.maximum(jnp.arange(p)[None, :] - pads[:, None], 0)
    cache = model.empty_cache(b, slots)
    # (layers, B, S, kv_heads, head_dim), or one cache per layer whose arrays start with B
    cache = _split_rows(cache, layout, axis=0 if isinstance(cache, tuple) else 1)
    logits, cache = model.cached(ids, positions, cache, jnp.int32(0), visible)
    rows = jnp.arange(b)
    seen = None  # the tokens each row holds (its prompt's, not its padding), where a penalty reads them
    if sampling.repetition_penalty != 1.0:
        held = jnp.arange(p)[None, :] >= pads[:, None]
        seen = _split_rows(jnp.zeros((b, logits.shape[-1]), bool).at[rows[:, None], ids].max(held), layout)
    keys = jax.random.split(jax.random.key(seed), max_new_tokens)
    first = _choose(logits[:, -1], sampling, keys[0], seen=seen)
    tokens = _split_rows(jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first), layout)
    Carry = tuple[jax.Array, jax.Array, jax.Array, Any, Any, Any]

    def step(i: jax.Array, carry: Carry) -> Carry:
        token, stopped, tokens, cache, weights, seen = carry  # token: column i's, (B,)
        slot = p + i
        position = (slot - pads)[:, None]
        # The weights ride in the carry, merged inside the loop: a module made outside a
        # loop cannot enter the nnx.scan over scanned layers inside it.
        model = nnx.merge(graphdef, weights)
        hidden, cache = model.cached_hidden(token[:, None], position, cache, slot, visible)
        logits = model.logits(_whole_rows(hidden, split))
        if seen is not None:
            seen = seen.at[rows, token].set(True)
        following = jnp.where(stopped, pad_id, _choose(logits[:, -1], sampling, keys[i + 1], split, seen))
        tokens = jax.lax.dynamic_update_slice(tokens, following[:, None], (0, i + 1))
        return following, stopped | jnp.isin(following, stop_ids), tokens, cache, weights, seen

    # The loop's weights split along their hidden units and vocabulary where FSDP splits them
    # along their width: no all-reduce of every step's logits (decode_layout)
    mesh = layout[0] if layout is not None else None
    weights, split = decode_layout(state, mesh), _vocab_split(mesh, logits.shape[-1])
    start = (first, jnp.isin(first, stop_ids), tokens, cache, weights, seen)
    return jax.lax.fori_loop(0, max_new_tokens - 1, step, start)[2]


def generate(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eos_ids: Sequence[int] = (),
    pad_id: int = 0,
    prompt_length: int | None = None,
) -> Generated:
    """The tokens each prompt continues with: at most ``max_new_tokens``, up to and with the
    first of ``eos_ids``.

    Args:
        model: the model, on whatever devices its state is (sharded state stays sharded).
        prompts: token ids per prompt (a batch of any lengths, each at least one token).
        max_new_tokens: the tokens generated per prompt at most (one compiled program per
            prompt length, batch, this number and sampling; a seed is no new program).
        sampling: greedy by default; one that samples without a seed draws one.
        eos_ids: the tokens that stop a sequence (its end of sequence, a chat model's end of
            turn, any other stop ids); each row stops at its own.
        pad_id: the id that pads short prompts (never attended to).
        prompt_length: the prompts left-padded to this many tokens at least (None: the
            longest prompt's), so that batches of other prompts run the same program.

    Returns:
        One list of token ids per prompt, with the sampling's seed (:class:`Generated`).

    Raises:
        ConfigError: the longest prompt and ``max_new_tokens`` do not fit the model's
            ``max_position_embeddings``, or a stop id is not in its vocabulary.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: generate at least one token")
    length = max(max(len(p) for p in prompts), prompt_length or 0)
    # Past the context the positions have no trained embedding, and the cache of length +
    # max_new_tokens slots is allocated up front: refused rather than run (or hung) on.
    context = model.cfg.max_position_embeddings
    if length + max_new_tokens > context:
        fix = f"give max_new_tokens={context - length} or fewer" if length < context else "shorten the prompt"
        raise ConfigError(
            f"the longest prompt's {length} tokens + max_new_tokens={max_new_tokens} = {length + max_new_tokens} is "
            f"more than the model's context (max_position_embeddings={context}); {fix}."
        )
    vocab = model.cfg.vocab_size
    outside = [t for t in eos_ids if not 0 <= t < vocab]
    if outside:
        raise ConfigError(
            f"stop id {outside[0]} is not a token of this model (its {vocab} ids are 0 to {vocab - 1}); give ids "
            "in that range."
        )
    sampling = (sampling or Sampling()).seeded()
    graphdef, state = nnx.split(model)
    layout = rows_layout(state)
    rows = -(-len(prompts) // row_shards(layout)) * row_shards(layout)  # copies of the first fill the split
    filled = [*prompts, *[prompts[0]] * (rows - len(prompts))]
    ids = np.full((rows, length), pad_id, np.int32)
    pads = np.array([length - len(p) for p in filled], np.int32)
    for row, prompt in enumerate(filled):
        ids[row, length - len(prompt) :] = prompt
    stops = np.array(sorted(set(eos_ids)), np.int32)
    seed = np.uint32(sampling.seed or 0)
    static = dataclasses.replace(sampling, seed=None)  # one program for every seed
    ids_in: jax.Array
    pads_in: jax.Array
    if layout is not None:  # the rows split as the train step splits a batch (the module docstring)
        ids_in = jax.make_array_from_callback(ids.shape, rows_sharding(layout, 2), lambda i: ids[i])
        pads_in = jax.make_array_from_callback(pads.shape, rows_sharding(layout, 1), lambda i: pads[i])
    else:
        ids_in, pads_in = jnp.asarray(ids), jnp.asarray(pads)
    tokens = to_host(
        _run(
            graphdef, state, ids_in, pads_in, jnp.asarray(stops), jnp.asarray(seed), max_new_tokens, static,
            jnp.int32(pad_id), layout,
        )
    )[: len(prompts)]  # fmt: skip
    out = Generated()
    stop = set(eos_ids)
    for row in tokens.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        out.append(row[:end])
    out.seed = sampling.seed if sampling.samples else None
    return out


def generation_program(
    model: LlamaForCausalLM,
    rows: int,
    prompt_length: int,
    max_new_tokens: int,
    sampling: Sampling,
    stops: int = 1,
) -> Any:
    """The program :func:`generate` runs for ``rows`` prompts of ``prompt_length`` tokens
    (left-padded), traced on the model's state as it lies (arrays, or ``ShapeDtypeStruct``s
    with their shardings: ``xlafit check --tpu`` compiles it for a TPU slice without one):
    ``generation_program(...).lower().compile()``. ``stops``: how many stop ids.

    Example:
        >>> traced = generation_program(model, 64, 128, 256, Sampling(temperature=1.0))  # doctest: +SKIP
        >>> traced.lower().compile().memory_analysis()  # doctest: +SKIP
    """
    graphdef, state = nnx.split(model)
    layout = rows_layout(state)
    rows = -(-rows // row_shards(layout)) * row_shards(layout)
    shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(state)]
    mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)

    def placed(shape: tuple[int, ...], dtype: Any, split: bool = False) -> jax.ShapeDtypeStruct:
        if layout is not None and split:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=rows_sharding(layout, len(shape)))
        sharding = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    static = dataclasses.replace(sampling, seed=None)
    return _run.trace(
        graphdef, state, placed((rows, prompt_length), jnp.int32, True), placed((rows,), jnp.int32, True),
        placed((stops,), jnp.int32), placed((), jnp.uint32), max_new_tokens, static, placed((), jnp.int32), layout,
    )  # fmt: skip
