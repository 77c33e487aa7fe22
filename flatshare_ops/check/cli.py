"""``serving-check``: verify the running engine against the node's active release.

Run from cron or ``serving-check.timer`` on each node. It uses argparse and
the standard library only (it runs every minute): no SSH, templates or CLI
framework is imported. Other nodes are checked from the operator's machine
with ``flatshare check --node NAME`` or ``--all``, which runs this on each
node over SSH.

Exit codes follow the Nagios plugin convention: 0 OK, 1 WARNING, 2 CRITICAL,
3 UNKNOWN (the check's own trouble, never a drifted engine).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..common.files import dumps

DEFAULT_STATE_DIR = Path("/var/lib/flatshare")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is the check's own trouble: UNKNOWN, exit 3 (not argparse's 2, CRITICAL)."""

    def error(self, message: str):  # noqa: D401 (argparse's hook)
        print(f"SERVING-CHECK UNKNOWN - {self.prog}: {message}")
        sys.exit(3)


class _Version(argparse.Action):
    """``-V/--version``: the version, exit 3 (UNKNOWN), as the monitoring-plugins guidelines ask of a plugin."""

    def __call__(self, parser, namespace, values, option_string=None):
        from .. import version

        print(f"serving-check (flatshare-ops {version()})")
        sys.exit(3)


def _seconds(text: str) -> float:
    """--deadline: a finite number of seconds above 0, at most an hour (the check runs every minute)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (0 < value <= 3600):  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds above 0 and at most 3600")
    return value


def _directory(text: str) -> Path:
    """--textfile: a directory named (an empty string would be the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give node_exporter's textfile directory, not an empty string")
    return Path(text)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="serving-check",
        description="Check that the running vLLM engine is what the node's active release says.",
    )
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                        help="the node's state directory (default /var/lib/flatshare)")
    parser.add_argument("--runtime-dir", type=Path, default=None,
                        help="a user-scope manager's XDG_RUNTIME_DIR (default: $XDG_RUNTIME_DIR)")
    parser.add_argument("--node-name", default=None, help="this node's name in messages (default: $FLATSHARE_NODE or the host name)")
    parser.add_argument("--quiet", action="store_true", help="print nothing when everything is OK (for cron)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--textfile", type=_directory, default=None, metavar="DIR",
                        help="also write DIR/serving_check.prom for node_exporter's textfile collector")
    parser.add_argument("--deadline", type=_seconds, default=10.0, metavar="SECONDS",
                        help="the whole run's bound (default 10 s): past it, what was checked is reported, "
                             "with an UNKNOWN finding naming the bound")
    parser.add_argument("-V", "--version", action=_Version, nargs=0, help="print the version and exit (UNKNOWN, 3)")
    # The release's own serving-check step (node/serving_check.py), holding the release lock: what the release
    # explains is not reported as a problem, and the node's state is not read (only a timer's run writes it).
    parser.add_argument("--inside-release", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--node", action="append", default=[], metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--all", action="store_true", help=argparse.SUPPRESS)
    return parser


def _print_report(report, args) -> None:
    from .report import nagios_text

    if args.json:
        print(dumps(report.to_json(), indent=2, sort_keys=True))
    elif not (args.quiet and report.status == "OK"):
        sys.stdout.write(nagios_text(report))


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the checks and exit with the Nagios code."""
    as_json = "--json" in (sys.argv[1:] if argv is None else argv)
    try:
        _main(argv)
    except BrokenPipeError:
        # The reader went away (``| head``): the exit code still carries the result.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(3)
    except SystemExit:
        raise
    except Exception as err:  # a monitoring plugin must say UNKNOWN, never crash with exit 1 (WARNING)
        message = f"serving-check failed: {type(err).__name__}: {err}"
        if as_json:
            from .report import UNKNOWN, Finding, Report

            node = os.environ.get("FLATSHARE_NODE") or os.uname().nodename
            print(dumps(Report(node, [Finding("serving_check", UNKNOWN, message)]).to_json(), sort_keys=True))
        else:
            print(f"SERVING-CHECK UNKNOWN - {message}")
        sys.exit(3)


def _main(argv: list[str] | None) -> None:
    args = _parser().parse_args(argv)
    if args.node or args.all:
        print("SERVING-CHECK UNKNOWN - serving-check checks this node; check other nodes from the operator's "
              "machine with 'flatshare check --node NAME' or 'flatshare check --all'")
        sys.exit(3)

    from .report import UNKNOWN, Finding, Report, write_textfile
    from .run import run_checks

    from ..common.text import one_line

    given = args.node_name or os.environ.get("FLATSHARE_NODE") or os.uname().nodename
    # The name goes into the Nagios line and a Prometheus label: a control character or a byte that is
    # not UTF-8 (argv keeps it as a surrogate) is shown escaped, and named as the check's own trouble.
    node = one_line(given).encode("utf-8", "backslashreplace").decode("utf-8")
    if args.state_dir.exists() and not args.state_dir.is_dir():
        report = Report(node, [Finding("release", UNKNOWN, f"--state-dir {args.state_dir} is not a directory")])
    else:
        report = run_checks(args.state_dir, node, args.runtime_dir, inside_release=args.inside_release,
                            deadline_s=args.deadline)
    if node != given:
        report.findings.append(Finding("node-name", UNKNOWN, f"the node name {node} holds control characters or "
                                                             "bytes that are not UTF-8; give --node-name as text"))
    if args.textfile:
        try:
            write_textfile(args.textfile, report)
        except OSError as err:
            # The check's own trouble: reported beside the findings, never instead of them.
            report.findings.append(Finding("textfile", UNKNOWN, f"cannot write {args.textfile}/serving_check.prom: "
                                                                f"{err.strerror or err}"))
    _print_report(report, args)
    sys.exit(report.exit_code)


if __name__ == "__main__":
    main()
