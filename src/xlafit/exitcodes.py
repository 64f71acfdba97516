"""Exit codes of the ``xlafit`` command that schedulers and scripts can act on."""

DAMAGED = 1  # xlafit inspect: the newest checkpoint is corrupt, or none is intact
USAGE = 2  # bad config, data, devices or checkpoint: the message says what to fix
NONFINITE = 3  # a non-finite loss or gradient under trainer.nan_policy=stop
PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGINT after saving a checkpoint; run again to resume
