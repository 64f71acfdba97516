"""A torch module's own ``torch.autograd.Function``s with their ``backward``, under torchax.

torchax runs a Function's ``forward`` as ordinary operations, and JAX differentiates those:
the Function's ``backward`` is never called. Where the two disagree, training is silently
wrong: a straight-through estimator (``forward`` rounds, ``backward`` passes the gradient
on) gives every layer below it a zero gradient. Here each such Function becomes a
``jax.custom_vjp`` whose backward is the Function's own, run on torchax tensors: the
gradients PyTorch's autograd would compute.

Supported: ``forward(ctx, ...)`` with ``backward(ctx, ...)``, or ``forward(...)`` with
``setup_context(ctx, inputs, output)``; tensors kept with ``ctx.save_for_backward`` or as
attributes of ``ctx``; one output or a tuple of them; ``None`` gradients. ``ctx.mark_dirty``
(an input changed in place) is refused: a compiled step has no in-place updates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from xlafit.errors import ConfigError


@contextlib.contextmanager
def own_backwards(env: Any) -> Iterator[None]:
    """While the torch module runs under torchax's ``env``: every ``torch.autograd.Function``
    that is not torch's or torchax's own differentiates through its ``backward``."""
    import torch

    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if not _users_function(cls):
            return original.__get__(None, cls)(*args, **kwargs)
        return _with_backward(cls, env, args, kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


def _users_function(cls: Any) -> bool:
    """A Function of the user's (not torch's nor torchax's) that defines its own backward."""
    from torch.autograd.function import _SingleLevelFunction

    module = getattr(cls, "__module__", "") or ""
    own = module.split(".")[0] not in ("torch", "torchax")
    return own and cls.backward is not _SingleLevelFunction.backward


class _Ctx:
    """What ``forward``/``setup_context`` and ``backward`` see as ``ctx``."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True
        self._saved: tuple[Any, ...] = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self._saved = tensors

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        return self._saved

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass  # its gradient is the backward's to give (PyTorch gives it zeros)

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    def mark_dirty(self, *tensors: Any) -> None:
        raise ConfigError(
            "a torch.autograd.Function of the module changes its input in place (ctx.mark_dirty), which a compiled "
            "step cannot do: return a new tensor instead."
        )


def _with_backward(cls: Any, env: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cls.apply(*args, **kwargs)`` as a ``jax.custom_vjp`` of the tensor arguments."""
    import torch

    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    arrays = tuple(env.t2j_iso(args[i]) for i in positions)
    differentiable = tuple(jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) for a in arrays)
    needs = tuple(i in positions and differentiable[positions.index(i)] for i in range(len(args)))
    kept: dict[str, Any] = {}  # the forward's ctx, for its backward (its tensors travel as residuals)

    def forward(arrays: tuple[Any, ...]) -> tuple[Any, _Ctx]:
        call = list(args)
        for i, a in zip(positions, arrays, strict=True):
            call[i] = env.j2t_iso(a)
        ctx = _Ctx(needs)
        with torch.no_grad():
            if _has_setup_context(cls):
                out = cls.forward(*call, **kwargs)
                cls.setup_context(ctx, tuple(call), out)
            else:
                out = cls.forward(ctx, *call, **kwargs)
        return out, ctx

    @jax.custom_vjp
    def function(*arrays: Any) -> Any:
        return env.t2j_iso(forward(arrays)[0])

    def function_fwd(*arrays: Any) -> tuple[Any, Any]:
        out, ctx = forward(arrays)
        attributes = {k: v for k, v in vars(ctx).items() if isinstance(v, torch.Tensor)}
        for name in attributes:  # a tracer of this trace may not be read by the backward's
            delattr(ctx, name)
        saved = ctx._saved
        ctx._saved = ()
        kept["ctx"] = ctx
        residuals = (env.t2j_iso(saved), env.t2j_iso(attributes))
        return env.t2j_iso(out), residuals

    def function_bwd(residuals: Any, cotangents: Any) -> tuple[Any, ...]:
        saved, attributes = residuals
        ctx = kept["ctx"]
        ctx._saved = env.j2t_iso(saved)
        for name, value in env.j2t_iso(attributes).items():
            setattr(ctx, name, value)
        # the backward runs when JAX transposes the step, after the module's call has left torchax
        with env, torch.no_grad(), jax.numpy_rank_promotion("allow"):
            grads = cls.backward(ctx, *(env.j2t_iso(c) for c in _as_tuple(cotangents)))
        grads = _as_tuple(grads)
        if len(grads) < len(args):
            raise ConfigError(
                f"{cls.__name__}.backward returned {len(grads)} gradient(s) for {len(args)} inputs of forward: "
                "return one for each input (None where it has none)."
            )
        return tuple(
            None if grads[i] is None or not ok else env.t2j_iso(grads[i]).astype(a.dtype).reshape(a.shape)
            for i, a, ok in zip(positions, arrays, differentiable, strict=True)
        )

    function.defvjp(function_fwd, function_bwd)
    return env.j2t_iso(function(*arrays))


def _has_setup_context(cls: Any) -> bool:
    from torch.autograd.function import _SingleLevelFunction

    return cls.setup_context is not _SingleLevelFunction.setup_context


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, tuple | list) else (x,)
