"""PyTorch modules in :class:`xlafit.Trainer`, through torchax (PyTorch code run on JAX).

The PyTorch/XLA user's way onto every core without ``xmp.spawn``: the ``torch.nn.Module`` is
converted once (:func:`to_adapted`, found by :mod:`xlafit.train.adapter` for any torch
module) into a :class:`TorchModule`, an ``nnx.Module`` whose ``nnx.Param`` variables are the
module's parameters and whose :class:`TorchBuffer` variables are its buffers (BatchNorm's
running statistics and counters), updated by the step as model state. ``train()`` /
``eval()`` map to the module's own. Dropout and any other randomness draw from a key of the
module's state (``nnx.Rngs``), one per call, as an NNX model's dropout does, never from
torchax's global key. A ``torch.autograd.Function`` of the module's own differentiates
through its ``backward`` (:mod:`xlafit.integrations.torch_function`). Trained values are
written back into the torch module at every checkpoint and at the end of ``fit``, so
``torch.save(module.state_dict())`` holds them.

The loss is ``loss_fn(model, batch)`` on JAX arrays, as for any model; :func:`torch_loss`
turns a torch function ``fn(outputs, batch) -> per-example losses`` into one.

Needs ``pip install 'xlafit[torch]'`` (torch 2.13 and the torchax pre-release that works with
it).
"""

from __future__ import annotations

import contextvars
import importlib.metadata
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlafit.errors import ConfigError
from xlafit.integrations.torch_function import own_backwards
from xlafit.train.adapter import Adapted, require_data_parallel
from xlafit.train.traced import where as users_line

TORCHAX_PIN = "torchax==0.0.14.dev20261026"  # the release that imports with torch 2.13 (xlafit[torch])


# torchax's environment is one per process (its mode, its PRNG key) and a torch module's
# train/eval flag is the module's: two threads tracing through them at once (a plan's and
# check's compiles run side by side) mixed each other's state. Traces take turns.
_ONE_AT_A_TIME = threading.RLock()


def torchax_env() -> Any:
    """torchax's environment; a one-line ``ConfigError`` naming the versions and the pin when
    torch and torchax are missing or do not work together."""
    try:
        import torchax
    except ImportError:
        raise ConfigError(
            f"training a torch module needs torchax: pip install 'xlafit[torch]' ({TORCHAX_PIN})."
        ) from None
    except Exception as e:  # an incompatible pair fails inside torchax's import
        versions = ", ".join(f"{p} {_version(p)}" for p in ("torch", "torchax"))
        raise ConfigError(
            f"torchax does not work with the installed torch ({versions}: {type(e).__name__}: {e}); "
            f"install the pair xlafit pins: pip install 'xlafit[torch]' (torch==2.13.0, {TORCHAX_PIN})."
        ) from None
    return torchax.default_env()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# True while a TorchModule runs its torch module through torchax (the BatchNorm hook's guard).
_THROUGH_TORCHAX = contextvars.ContextVar("xlafit_through_torchax", default=False)


def _running_statistics(module: Any, inputs: tuple[Any, ...], output: Any) -> None:
    """A BatchNorm forward hook: torchax's batch norm computes the new running statistics but
    does not write them into the module's buffers, so this does, as PyTorch would (the batch
    mean, the unbiased batch variance, ``momentum``, or the cumulative average when it is None)."""
    if not (_THROUGH_TORCHAX.get() and module.training and module.track_running_stats):
        return
    import torch

    x = inputs[0].detach()
    dims = [0, *range(2, x.dim())]
    factor = module.momentum if module.momentum is not None else 1.0 / float(module.num_batches_tracked)
    with torch.no_grad():
        module.running_mean.mul_(1 - factor).add_(x.mean(dims) * factor)
        module.running_var.mul_(1 - factor).add_(x.var(dims, unbiased=True) * factor)


class TorchBuffer(nnx.Variable):
    """A torch module's buffer: BatchNorm's running statistics, its batch counter."""


class TorchModule(nnx.Module):
    """A ``torch.nn.Module`` as an ``nnx.Module``: what :class:`xlafit.Trainer` trains.

    Args:
        module: the torch module (on the CPU; its values are copied).
        seed: the seed of the module's randomness (dropout).

    Example:
        >>> import torch
        >>> module = TorchModule(torch.nn.Linear(3, 2))
        >>> module(jnp.ones((4, 3))).shape
        (4, 2)
    """

    def __init__(self, module: Any, seed: int = 0) -> None:
        torchax_env()
        import torch
        from torchax.interop import JittableModule

        self.torch_module = module
        for sub in module.modules():
            if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
                sub.register_forward_hook(_running_statistics)
        self.jittable = JittableModule(module)
        self.param_names = list(self.jittable.params)
        self.buffer_names = list(self.jittable.buffers)
        host = {**self.jittable.params, **self.jittable.buffers}
        self.params = nnx.List([nnx.Param(_to_jax(host[n])) for n in self.param_names])
        self.buffers = nnx.List([TorchBuffer(_to_jax(host[n])) for n in self.buffer_names])
        self.rngs = nnx.Rngs(dropout=seed)
        self.deterministic = True  # nnx's train()/eval() flag: the module's training = not deterministic

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _ONE_AT_A_TIME:
            return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        env = torchax_env()
        args, kwargs = jax.tree.map(jnp.asarray, (args, kwargs))  # NumPy inputs as JAX arrays, as jit makes them
        params = {n: p[...] for n, p in zip(self.param_names, self.params, strict=True)}
        buffers = {n: b[...] for n, b in zip(self.buffer_names, self.buffers, strict=True)}
        self.torch_module.train(not self.deterministic)
        key = self.rngs.dropout() if not self.deterministic else None
        saved = env.prng_key
        try:
            if key is not None:
                env.prng_key = key  # the call's randomness is this step's key, not torchax's global one
            t_params, t_buffers, t_args, t_kwargs = env.j2t_iso((params, buffers, args, kwargs))
            through = _THROUGH_TORCHAX.set(True)
            try:
                # PyTorch broadcasts by rank promotion, which strict JAX settings forbid: allowed for its ops
                with env, jax.numpy_rank_promotion("allow"), own_backwards(env):
                    out = self.jittable.functional_call("__call__", t_params, t_buffers, *t_args, **t_kwargs)
            except Exception as e:
                raise _not_runnable(e) from e
            finally:
                _THROUGH_TORCHAX.reset(through)
            new_buffers = env.t2j_iso(t_buffers)  # updated in place by the forward (BatchNorm)
            out = env.t2j_iso(out)
        finally:
            env.prng_key = saved
        for name, variable in zip(self.buffer_names, self.buffers, strict=True):
            variable[...] = new_buffers[name]
        return out

    def write_back(self, params: nnx.State, model_state: nnx.State) -> None:
        """Puts trained values into this module and into the torch module's tensors (each from
        its first local shard: the trainer donates its state to the next step)."""
        import torch

        def local(x: jax.Array) -> jax.Array:
            return x.addressable_data(0).copy()

        nnx.update(self, jax.tree.map(local, params), jax.tree.map(local, model_state))
        tensors = {**dict(self.torch_module.named_parameters()), **dict(self.torch_module.named_buffers())}
        names = [*self.param_names, *self.buffer_names]
        with torch.no_grad():
            for name, variable in zip(names, [*self.params, *self.buffers], strict=True):
                tensors[name].copy_(torch.from_numpy(np.array(variable[...])))


def _not_runnable(e: Exception) -> Exception:
    """What torchax cannot run, as one line naming the operation and the user's line; any other
    error as it is (a tracing error of the user's own code is ``xlafit check``'s to classify)."""
    kind = type(e).__name__
    mixed = isinstance(e, AssertionError) and "mixed math" in str(e)
    traced = isinstance(e, jax.errors.ConcretizationTypeError | jax.errors.NonConcreteBooleanIndexError)
    if kind != "OperatorNotFound" and not mixed and not traced:
        return e
    where = users_line(e)
    if traced:
        return ConfigError(
            f"the torch module's Python control flow or output shape depends on the data{where}, which a compiled "
            "step cannot follow; compute both branches and select (torch.where), or give the result a fixed size. "
            "`xlafit check FILE` finds every such line."
        )
    if mixed:
        return ConfigError(
            f"the torch module makes a tensor of its own{where} and uses it with the model's: under torchax it must "
            "come from an input or a buffer (x.new_ones(...), torch.ones(..., device=x.device), register_buffer)."
        )
    return ConfigError(f"torchax cannot run the module{where}: {e}; rewrite that line with operations torchax has.")


def _to_jax(tensor: Any) -> jax.Array:
    return jnp.asarray(tensor.detach().cpu().numpy())


def torch_loss(fn: Callable[[Any, Mapping[str, Any]], Any], inputs: str = "x") -> Callable:
    """``loss_fn(model, batch)`` from a torch function ``fn(outputs, batch)`` of torch tensors
    that returns per-example losses (or ``(losses, {metric: per-example values})``); the model
    is called on ``batch[inputs]``.

    Example:
        >>> import torch
        >>> loss_fn = torch_loss(lambda out, b: torch.nn.functional.cross_entropy(out, b["y"], reduction="none"))
        >>> losses = loss_fn(TorchModule(torch.nn.Linear(3, 2)), {"x": jnp.ones((4, 3)), "y": jnp.zeros(4, jnp.int32)})
        >>> losses.shape
        (4,)
    """

    def loss_fn(model: TorchModule, batch: Mapping[str, Any]) -> Any:
        outputs = model(batch[inputs])
        env = torchax_env()
        with _ONE_AT_A_TIME:
            t_outputs, t_batch = env.j2t_iso((outputs, dict(batch)))
            with env, jax.numpy_rank_promotion("allow"), own_backwards(env):
                result = fn(t_outputs, t_batch)
            return env.t2j_iso(result)

    loss_fn.xlafit_torch_loss = True  # type: ignore[attr-defined]  # to_adapted: no second wrapper
    return loss_fn


def _torch_ops_named(loss_fn: Callable) -> Callable:
    """``loss_fn``, whose torch function given a JAX array becomes one error naming the fix.

    The adapted module returns JAX arrays, so a loss written in torch operations on
    ``model(batch["x"])`` fails inside torch ("must be Tensor, not ...Tracer"): such a loss
    goes through :func:`torch_loss`, or is written in ``jax.numpy``.
    """

    def checked(model: Any, batch: Mapping[str, Any]) -> Any:
        try:
            return loss_fn(model, batch)
        except TypeError as e:
            if "must be Tensor" not in str(e):
                raise
            if type(model).__name__ in str(e):
                raise ConfigError(
                    f"loss_fn passed the model itself to a torch function ({str(e).splitlines()[0]}): "
                    "loss_fn(model, batch) gets the model; call it on the inputs (model(batch['x'])) and give the "
                    "outputs to the loss, or write loss_fn = xlafit.integrations.torch.torch_loss(fn), whose "
                    "fn(outputs, batch) gets the model's outputs as torch tensors."
                ) from e
            raise ConfigError(
                f"loss_fn passed a JAX array to a torch function ({str(e).splitlines()[0]}): with a torch module "
                "the model's outputs are JAX arrays. Write the loss in torch as "
                "loss_fn = xlafit.integrations.torch.torch_loss(fn), fn(outputs, batch) of torch tensors "
                "(the model is called on batch['x']), or in jax.numpy."
            ) from e

    return checked


def to_adapted(module: Any, loss_fn: Any, seed: int = 0) -> Adapted:
    """A torch module as the trainer takes it (:mod:`xlafit.train.adapter`)."""
    if loss_fn is None:
        raise ConfigError("a torch module needs a loss_fn(model, batch), or torch_loss(fn) for a torch function.")
    if not getattr(loss_fn, "xlafit_torch_loss", False):
        loss_fn = _torch_ops_named(loss_fn)
    converted = TorchModule(module, seed)
    check = lambda strategy, config: require_data_parallel(strategy, "torch modules")  # noqa: E731
    return Adapted(converted, loss_fn, write_back=converted.write_back, check=check)
