"""serving-check: runs on each node (cron or its timer) and says whether the engine is what the release says.

``report`` (findings, Nagios and textfile output), ``facts`` (what it reads
from systemd, the venv, /metrics), ``checks`` (one function per check),
``run`` (one run), ``cli`` (the ``serving-check`` entry point). Standard
library and pystemd only (adr/0006-serving-check-cost.md).
"""
