"""How long a compiled training step takes on a device: the step model.

The compiled (optimised) program of a step is a sequence of kernels: fusions, library calls
(cuBLAS, cuDNN, Pallas), copies and collectives (:mod:`xlafit.predict.ops` reads them with
their FLOPs, bytes and element-wise work). Each is priced at the device's *achievable* rates
(:mod:`xlafit.predict.rates`: fitted to micro-benchmarks of the device, to published
measured steps, or measured here by ``xlafit bench --calibrate``,
:mod:`xlafit.predict.calibrate`), and the step is their sum along the schedule, collectives
hidden where the schedule overlaps them (:mod:`xlafit.predict.model`). Every row of rates
carries the error its predictions showed against measured steps held out of its fit
(:mod:`xlafit.predict.validation`); ``check --tpu`` and ``plan`` print it beside each
prediction.

Example:
    >>> rates = rates_for("TPU v6 lite")
    >>> rates.band.basis
    'published'
"""

from xlafit.predict.model import StepPrediction, predict
from xlafit.predict.ops import Kernel, kernels
from xlafit.predict.rates import Band, Rates, rates_for

__all__ = ["Band", "Kernel", "Rates", "StepPrediction", "kernels", "predict", "rates_for"]
