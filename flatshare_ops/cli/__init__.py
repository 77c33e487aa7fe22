"""``flatshare``: the operator's command line, one module per area (:mod:`.app` says which). Argument parsing and
exit codes only.

Exit codes are :class:`flatshare_ops.errors.Exit`'s (README.md, "Exit codes"); ``flatshare check`` uses
serving-check's Nagios codes. An operator's error is one line naming the place, the rule and the way out,
never a traceback.
"""

from __future__ import annotations

import sys

from ..errors import FlatshareError
from . import profiles, reports, sandbox, nodes, hold, release  # noqa: F401, I001  (each registers its commands)
from .app import app


def main() -> None:
    """Console-script entry point: run the app, turning operator errors into one line and an exit code."""
    try:
        app()
    except FlatshareError as err:
        print(f"flatshare: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
