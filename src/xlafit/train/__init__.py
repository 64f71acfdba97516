"""Training: the train state and pure steps, optimizer planning, and the trainer's loop."""

from xlafit.errors import NonFiniteError, Preempted, RecompileError
from xlafit.train import losses
from xlafit.train.compiled import CompiledStep
from xlafit.train.loop import Call, FitResult
from xlafit.train.optim import OptimizerPlan, make_optimizer, make_schedule, scaled_lr
from xlafit.train.signals import handle_signals
from xlafit.train.state import TrainState
from xlafit.train.trainer import Trainer

__all__ = [
    "Call",
    "CompiledStep",
    "FitResult",
    "NonFiniteError",
    "OptimizerPlan",
    "Preempted",
    "RecompileError",
    "TrainState",
    "Trainer",
    "handle_signals",
    "losses",
    "make_optimizer",
    "make_schedule",
    "scaled_lr",
]
