"""Training: the train state, step builders, optimizer planning and the trainer."""

from xlafit.train.optim import OptimizerPlan, make_optimizer, make_schedule, scaled_lr
from xlafit.train.step import CompiledStep, TrainState
from xlafit.train.trainer import FitResult, Trainer

__all__ = [
    "CompiledStep",
    "FitResult",
    "OptimizerPlan",
    "TrainState",
    "Trainer",
    "make_optimizer",
    "make_schedule",
    "scaled_lr",
]
