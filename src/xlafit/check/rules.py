"""The three XLA rules a train step must follow, and how a failure maps to one of them.

From the Hugging Face TPU guide, checked on the CPU before the TPU:

1. no data-dependent Python control flow (``if``/``while`` on an array's value);
2. no data-dependent shapes (boolean-mask indexing, ``jnp.unique``, ``jnp.nonzero``);
3. every new input shape compiles a new program: pad to a few fixed shapes.

:func:`classify` reads a tracing failure as one of them, with the user's file and line.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import jax

from xlafit.train.traced import frame_in

RULES = {
    1: "data-dependent control flow",
    2: "data-dependent shape",
    3: "too many input shapes (each compiles a new program)",
}

FIXES = {
    1: """# Python `if`/`while` cannot branch on a traced value. Compute both and select:
y = jnp.where(x.sum() > 0, f(x), g(x))
# or run one branch (both must return the same shapes):
y = jax.lax.cond(x.sum() > 0, f, g, x)
# loops with a data-dependent trip count: jax.lax.while_loop(cond_fn, body_fn, init)""",
    2: """# A result whose shape depends on the data cannot be compiled. Compute everywhere and
# weight by a mask instead of selecting:
loss = jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1)   # not losses[mask].mean()
# or give the result a fixed size:
values = jnp.unique(x, size=16, fill_value=-1)
idx = jnp.nonzero(mask, size=16, fill_value=0)""",
    3: """# Pad to a few fixed shapes instead of each batch's own length:
from xlafit.data.shapes import pad_batch, plan_buckets, bucket_batches
batch = pad_batch(sequences, multiple=32)                       # or, fewer wasted tokens:
boundaries = plan_buckets(lengths, max_shapes=4)
batches = bucket_batches(sequences, boundaries, batch_size=32)""",
}


# The same rewrites in the operations of a model written with PyTorch (through torchax) or
# Keras 3: `check` shows them for a file whose `model` is one.
FRAMEWORK_FIXES = {
    "torch": {
        1: """# Python `if`/`while` cannot branch on a traced value. Compute both and select:
y = torch.where(x.sum() > 0, f(x), g(x))
# loops with a data-dependent trip count: a fixed number of steps, masked with torch.where""",
        2: """# A result whose shape depends on the data cannot be compiled. Compute everywhere and
# weight by a mask instead of selecting:
loss = (losses * mask).sum() / mask.sum().clamp(min=1)   # not losses[mask].mean()""",
    },
    "keras": {
        1: """# Python `if`/`while` cannot branch on a traced value. Compute both and select:
y = keras.ops.where(keras.ops.sum(x) > 0, f(x), g(x))
# or run one branch (both must return the same shapes):
y = keras.ops.cond(keras.ops.sum(x) > 0, lambda: f(x), lambda: g(x))""",
        2: """# A result whose shape depends on the data cannot be compiled. Compute everywhere and
# weight by a mask instead of selecting:
loss = keras.ops.sum(losses * mask) / keras.ops.maximum(keras.ops.sum(mask), 1)   # not losses[mask]""",
    },
}


@dataclasses.dataclass
class Finding:
    """One problem: which rule (0: not one of the three), where, and the rewrite."""

    rule: int
    message: str
    file: str | None = None
    line: int | None = None
    code: str | None = None
    kind: str = "error"  # the title of a finding that is not one of the rules
    framework: str | None = None  # "torch", "keras": the model's framework, for the rewrite

    @property
    def title(self) -> str:
        return f"rule {self.rule}: {RULES[self.rule]}" if self.rule else self.kind

    @property
    def fix(self) -> str | None:
        return FRAMEWORK_FIXES.get(self.framework or "", {}).get(self.rule) or FIXES.get(self.rule)


def _user_frame(exc: BaseException, user_file: str | None) -> tuple[str | None, int | None]:
    """The deepest frame of ``exc`` in ``user_file``: its file name and line."""
    frame = frame_in(exc, user_file)
    return (frame.filename, frame.lineno) if frame is not None else (None, None)


def _is_control_flow(source: str, line: int) -> bool:
    """Whether the statement at ``line`` branches or loops on a condition (an ``if``,
    ``while``, ``assert``, conditional expression or ``and``/``or``)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.Assert)):
            if node.test.lineno <= line <= (node.test.end_lineno or node.test.lineno):
                return True
        if isinstance(node, (ast.IfExp, ast.BoolOp)) and node.lineno <= line <= (node.end_lineno or node.lineno):
            return True
    return False


def classify(exc: BaseException, user_file: str | None) -> Finding:
    """Maps a tracing or run failure to rule 1, 2 or a plain error, at the user's line."""
    tracing = (jax.errors.ConcretizationTypeError, jax.errors.NonConcreteBooleanIndexError)
    if isinstance(exc.__cause__, tracing):  # an adapter's one-line error about a traced value: the rule is its cause's
        exc = exc.__cause__
    file, line = _user_frame(exc, user_file)
    source = Path(file).read_text() if file else ""
    code = source.splitlines()[line - 1].strip() if file and line else None
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    errors = jax.errors
    if isinstance(exc, (errors.TracerBoolConversionError, errors.TracerIntegerConversionError)):
        rule = 1
    elif isinstance(exc, errors.NonConcreteBooleanIndexError):
        rule = 2
    elif isinstance(exc, errors.ConcretizationTypeError):
        rule = 1 if file and line and _is_control_flow(source, line) else 2
    elif isinstance(exc, errors.TracerArrayConversionError):
        rule = 1 if file and line and _is_control_flow(source, line) else 0
        first_line = "a traced value was converted to a NumPy array (np.* or float() on it); use jnp.* instead"
    else:
        rule = 0
    if rule == 1:
        message = "Python control flow on a traced value: the branch taken depends on the data. " + first_line
    elif rule == 2:
        message = "an operation whose output shape depends on the data. " + first_line
    else:
        message = f"{type(exc).__name__}: {first_line}"
    return Finding(rule, message, file, line, code)


# --------------------------------------------------------------------------- checking
