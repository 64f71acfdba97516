"""The environment variables that describe a job to :func:`xlafit.connect` (stdlib only: the
``xlafit`` command names them in its help without importing JAX)."""

SIMULATE_ENV = "XLAFIT_SIMULATE_DEVICES"
COORDINATOR_ENV = "XLAFIT_COORDINATOR"
NUM_PROCESSES_ENV = "XLAFIT_NUM_PROCESSES"
PROCESS_ID_ENV = "XLAFIT_PROCESS_ID"
INIT_TIMEOUT_ENV = "XLAFIT_INIT_TIMEOUT_S"  # how long to wait for every process to join
DISTRIBUTED_ENV = "XLAFIT_DISTRIBUTED"  # "1": join a job that JAX detects (TPU pod slice, ...)
