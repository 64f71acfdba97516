"""A pytest plugin that sums JAX's monitoring events (compile, lowering, cache) over a session
and writes them with the wall time to ``/tmp/cprof/out-<pid>.json``:
``PYTHONPATH=<this folder> pytest -p compile_events_plugin ...``."""

import collections
import json
import os
import time

import jax._src.monitoring as monitoring

TOTAL: collections.Counter = collections.Counter()
_START = time.time()


def _listen(event, duration, **_):
    TOTAL[event] += duration


monitoring.register_event_duration_secs_listener(_listen)


def pytest_sessionfinish(session):
    out = {k: round(v, 1) for k, v in TOTAL.items()}
    out["wall"] = round(time.time() - _START, 1)
    os.makedirs("/tmp/cprof", exist_ok=True)
    with open(f"/tmp/cprof/out-{os.getpid()}.json", "w") as f:
        json.dump(out, f, indent=1)
