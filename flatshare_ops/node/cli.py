"""``flatshare-node``: the node's side of every command, run by the operator's side (locally or over SSH).

argparse and the standard library at start (the switch imports more only
when it runs), so that the node's side costs little to start. Commands:

- ``switch``: carry out a release, a rollback or a rollout's undo. stdin: the
  release bundle as one JSON line (``{}`` for a rollback), then the operator's
  answers to admission requests. stdout: progress lines for people, and the
  protocol's lines (:mod:`flatshare_ops.common.protocol`: an admission
  request; the outcome, last).
- ``status`` (``--switch ID``: what became of one switch), ``history``,
  ``probe`` (does this node take calls, does a release hold it), ``module``,
  ``hold``, ``lock-check`` (does reading the release lock work here): one JSON
  document each.

Exit codes are :class:`flatshare_ops.errors.Exit`'s.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from pathlib import Path

from ..common import protocol
from ..common.files import dumps, loads
from ..errors import Exit, FlatshareError

#: How long the node waits for the operator's answer to an admission request (seconds).
ADMISSION_TIMEOUT_S = protocol.ADMISSION_WAIT_S


class _Stdin:
    """Lines from stdin read without Python's buffering, each read bounded."""

    def __init__(self) -> None:
        self.buffer = b""
        self.closed = False

    def line(self, timeout_s: float) -> str | None:
        """The next line, or None at end of input or after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer and not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([0], [], [], left)
            if ready:
                chunk = os.read(0, 1 << 20)
                if not chunk:
                    self.closed = True
                self.buffer += chunk
        if b"\n" in self.buffer:
            line, _, self.buffer = self.buffer.partition(b"\n")
            return line.decode(errors="replace")
        if self.buffer:
            line, self.buffer = self.buffer, b""
            return line.decode(errors="replace")
        return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flatshare-node", description="The node's side of flatshare-ops.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("switch", "switch this node (bundle on stdin)"), ("status", "this node's state as JSON"),
                       ("history", "this node's release history as JSON"),
                       ("probe", "whether this node takes calls and whether a release holds it, as JSON"),
                       ("module", "the serve module this node built (path, sha256), as JSON"),
                       ("metrics", "this node's engine /metrics (for a canary analysis), as JSON"),
                       ("answers", "this node's engine's greedy answers to golden prompts (a JSON list on stdin), as JSON"),
                       ("record-analysis", "record a canary analysis of this node's release (JSON on stdin)"),
                       ("hold", "an operator's hold on this node (flatshare hold), as JSON"),
                       ("lock-check", "whether reading the release lock works here (a child takes a lock), as JSON")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--node", required=True, help="this node's name")
        p.add_argument("--state-dir", required=True, type=Path, help="the node's state directory")
        p.add_argument("--scope", choices=("system", "user"), default="system", help="its systemd manager")
        p.add_argument("--runtime-dir", type=Path, default=None, help="a user manager's XDG_RUNTIME_DIR")
        if name == "switch":
            p.add_argument("--force", action="store_true", help="release even with E2 drop-ins linked")
            p.add_argument("--dry-run", action="store_true", help="decide and print; change nothing")
            p.add_argument("--rollback", action="store_true", help="roll back by the node's rule")
            p.add_argument("--undo-rollout", default=None, help="go back to what ran before this rollout")
            p.add_argument("--switch-id", default="", help="this switch's id (the operator's)")
            p.add_argument("--rollout", default=None, help="the rollout this switch belongs to")
            p.add_argument("--no-auto-rollback", action="store_true",
                           help="a release whose new engine does not serve stays failed (no automatic rollback)")
            p.add_argument("--bundle-file", type=Path, default=None,
                           help="the bundle, read from this file (the entry point's) instead of stdin's first line")
        if name == "status":
            p.add_argument("--switch", default=None, help="what became of this switch")
        if name == "module":
            p.add_argument("--path", default=None, help="the module file (default: the active release's)")
        if name == "answers":
            p.add_argument("--max-tokens", type=int, required=True, help="tokens generated for each (1 to 256)")
            p.add_argument("--budget", type=float, default=25.0, help="seconds for all the answers (default 25)")
        if name == "record-analysis":
            p.add_argument("--switch", required=True, help="the switch the analysis judged")
            p.add_argument("--rollout", default=None, help="the rollout it belongs to")
        if name == "hold":
            p.add_argument("--acquire", metavar="MESSAGE", default=None, help="hold the node, saying why")
            p.add_argument("--who", default=None, help="who holds it (default user@host)")
            p.add_argument("--release", action="store_true", help="lift the hold")
    return parser


def _context(args):
    from ..common.systemd import ManagerAddress
    from .context import NodeContext

    return NodeContext(args.node, args.state_dir, ManagerAddress(args.scope, args.runtime_dir))


def _emit(message) -> None:
    """A protocol line on stdout (never in release.log)."""
    try:
        os.write(1, protocol.line(message).encode())
    except OSError:
        pass  # the operator is gone; the switch goes on


def _on_sigterm(_signum, _frame):
    from .runner import Interrupted

    raise Interrupted("SIGTERM")


def _result_of(err: FlatshareError) -> protocol.OutcomeResult:
    """The result word (:mod:`common.protocol`) of an error that ended a switch command."""
    from ..errors import Refused, SwitchFailed

    if isinstance(err, Refused):
        return protocol.OutcomeResult.REFUSED
    if isinstance(err, SwitchFailed):
        return protocol.OutcomeResult.FAILED
    return protocol.OutcomeResult.FAILED if err.exit_code == Exit.FAILED else protocol.OutcomeResult.REFUSED


def switch(args) -> int:
    """``flatshare-node switch``: read the request, run it, print the outcome (and keep it: node/outcomes.py)."""
    from .output import ReleaseOutput
    from .switch import Request, switch_node, validate_bundle

    ctx = _context(args)
    stdin = _Stdin()
    mode = protocol.Mode.UNDO_ROLLOUT if args.undo_rollout else protocol.Mode.ROLLBACK if args.rollback \
        else protocol.Mode.RELEASE
    if args.bundle_file is not None:
        from ..common.files import Damaged, read_bytes

        try:
            if str(args.bundle_file).startswith("/dev/fd/"):
                first = args.bundle_file.read_text()  # the entry point's pipe: written whole and closed, never waits
            else:  # a file in releases/.incoming/: read bounded, never blocking on what is there
                first = (read_bytes(args.bundle_file, limit=256 << 20) or b"").decode("utf-8", errors="replace")
                args.bundle_file.unlink()
        except (OSError, Damaged) as err:
            raise FlatshareError(f"node switch: cannot read the bundle {args.bundle_file} ({err})") from None
    else:
        first = stdin.line(30.0)
    if mode == protocol.Mode.RELEASE and not first:
        raise FlatshareError("node switch: a release needs its bundle as the first line of stdin")
    try:
        bundle = loads(first) if first else None
    except ValueError as err:
        raise FlatshareError('node switch: stdin is not JSON; expected a release bundle {"id", "files"} '
                             f"({err})") from None
    if isinstance(bundle, dict) and "progress_every_s" in bundle:
        from ..common import poll

        try:
            poll.set_progress_every(bundle["progress_every_s"])
        except ValueError as err:
            raise FlatshareError(f"node switch: {err}") from None
    request = Request(mode=mode, bundle=validate_bundle(bundle) if mode == protocol.Mode.RELEASE else None,
                      force=args.force, dry_run=args.dry_run, switch=args.switch_id, rollout=args.rollout,
                      undo=args.undo_rollout, auto_rollback=not args.no_auto_rollback,
                      full_plan=not (isinstance(bundle, dict) and bundle.get("plan") == protocol.PlanForm.COMPACT),
                      preflight_only=args.dry_run and isinstance(bundle, dict) and bundle.get("preflight_only") is True)
    try:
        ctx.releases.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # the switch names it (node/store.py ensure_releases_dir); release.log then says it is not kept
    out = ReleaseOutput(None if args.dry_run else ctx.log_path, nonblocking=True)
    out.watch_hangup()
    if request.switch:  # the operator's side reads protocol lines: where the switch stands goes as Progress
        out.switch = request.switch

    marked: dict[str, str | None] = {}  # the history's mark as this switch found it (AdmitRequest.history)

    def admit(plan, drains: bool = True, say: bool = True) -> str | None:
        from .probe import node_identity

        load = None
        if drains:
            out.line(f"{ctx.node}: asking the operator's side for admission to drain")
            from ..errors import NodeStateError
            from .calls import active_serving
            from .probe import engine_load
            from .store import current_release

            try:  # what draining this node moves onto the others: its engine's load now
                load = engine_load(active_serving(ctx, current_release(ctx.state_dir)))
            except NodeStateError as err:
                load = {"error": str(err)}
        elif say:
            out.line(f"{ctx.node}: asking the operator's side whether to go on")
        if "history" not in marked:  # read once, at the first ask: the lock is held, only this switch writes it
            marked["history"] = _history_mark(ctx)
        _emit(protocol.AdmitRequest(ctx.node, request.switch, args.dry_run, node_identity(ctx), load, drains,
                                    marked["history"]))
        answer = stdin.line(ADMISSION_TIMEOUT_S)
        asked = "the admission request" if drains else "the go-ahead request"
        if answer is None and stdin.closed:
            return (f"the operator's side went away before answering {asked} (interrupted, or "
                    "not run through 'flatshare release', which asks the other nodes)")
        if answer is None:
            return (f"no answer to {asked} within {ADMISSION_TIMEOUT_S:g} s "
                    "(run releases through 'flatshare release', which asks the other nodes)")
        document = protocol.parse_answer(answer)
        if document is None:
            return f"the admission answer was not one ({answer[:80]!r})"
        if document.admit:
            return None
        return document.reason or "refused by the operator's side"

    def confirm(say: bool = True) -> str | None:
        """The operator's side's go-ahead before this switch's first change and before its admission to drain
        (``say``: with a line saying it asks)."""
        return admit(None, drains=False, say=say)

    try:
        done = switch_node(ctx, request, out, admit,
                           confirm if isinstance(bundle, dict) and bundle.get("confirm") is True else None)
        outcome = protocol.Outcome(request.switch, int(done.code), done.result, done.release, done.message,
                                   done.detail, done.first, done.unjudged, done.before, done.commit, done.drained_s,
                                   done.engine_start_s, done.plan)
        if done.code == Exit.ROLLED_BACK:
            out.line(f"flatshare: {ctx.node}: rolled back automatically: {done.message}")
    except FlatshareError as err:
        out.line(f"flatshare: {err}")
        outcome = protocol.Outcome(request.switch, int(err.exit_code), _result_of(err), None, str(err),
                                   refused_for=getattr(err, "waits_for", None))
    except Exception as err:  # a bug: one line for the operator, the traceback kept in release.log
        import traceback

        out.log_only(traceback.format_exc())
        message = (f"unexpected {type(err).__name__}: {err} (a bug in flatshare-ops; the traceback is in "
                   f"{ctx.log_path}; 'flatshare status --node {ctx.node}' shows the node's state)")
        out.line(f"flatshare: {message}")
        outcome = protocol.Outcome(request.switch, int(Exit.FAILED), protocol.OutcomeResult.FAILED, None, message)
    except BaseException as err:  # an interrupt before the switch began: nothing was changed
        from .runner import Interrupted

        if not isinstance(err, (KeyboardInterrupt, Interrupted)):
            out.close()
            raise
        name = err.signal_name if isinstance(err, Interrupted) else "SIGINT"
        out.line(f"flatshare: interrupted by {name} before the switch began; nothing was changed")
        code = Exit.TERMINATED if name == "SIGTERM" else Exit.INTERRUPTED
        outcome = protocol.Outcome(request.switch, int(code), protocol.OutcomeResult.INTERRUPTED, None,
                                   f"interrupted by {name} before the switch began; nothing was changed")
    if not args.dry_run:
        _keep(ctx, outcome, out)
    out.close()
    _emit(outcome)
    return int(outcome.code)


def _keep(ctx, outcome, out) -> None:
    """Keep the outcome on the node for a follow-up (node/outcomes.py); a failed write is said, never fatal."""
    from ..common.files import Damaged
    from . import outcomes
    from .runner import describe_failure

    try:
        outcomes.append(ctx, outcome)
    except (OSError, ValueError) as err:
        why = err.form if isinstance(err, Damaged) else describe_failure(err)
        out.line(f"note: this command's outcome could not be kept in {ctx.releases / outcomes.OUTCOMES} "
                 f"({why}); it was still sent, and the history records any switch")


def _not_an_analysis(document) -> str | None:
    """What makes ``document`` no analysis document the node records (control/analysis.py's ``document()``
    shape, read as untrusted), or None: a JSON object whose ``summary`` is text, whose ``measurements`` is a
    list of objects, each ``canary`` an object whose ``start_s`` is a time (seconds since the epoch)."""
    import math

    if not isinstance(document, dict):
        return "not a JSON object"
    if not isinstance(document.get("summary", ""), str):
        return "its summary is not text"
    measurements = document.get("measurements", [])
    if not isinstance(measurements, list):
        return "its measurements are not a list"
    for number, measurement in enumerate(measurements, 1):
        if not isinstance(measurement, dict) or not isinstance(measurement.get("canary", {}), dict):
            return f"measurement {number} is not an object with a canary object"
        start = measurement.get("canary", {}).get("start_s")
        if start is not None and (isinstance(start, bool) or not isinstance(start, (int, float))
                                  or not math.isfinite(start) or not 0 <= start < 1e11):
            return f"measurement {number}'s canary start_s is not a time in seconds since the epoch"
    return None


def _record_analysis(args) -> int:
    """``flatshare-node record-analysis``: the analysis document (one JSON object) on stdin, into history."""
    from .records import append_analysis
    from .store import current_release

    ctx = _context(args)
    text = _Stdin().line(30.0)
    try:
        document = loads(text or "")
    except ValueError as err:
        raise FlatshareError(f"node record-analysis: stdin is not JSON ({err})") from None
    wrong = _not_an_analysis(document)
    if wrong:
        raise FlatshareError(f"node record-analysis: stdin is not an analysis document: {wrong}")
    try:
        record = append_analysis(ctx, args.switch, args.rollout, current_release(ctx.state_dir), document)
    except (OSError, ValueError) as err:  # a full or read-only disk, an immutable file; a record past its bounds
        from .runner import describe_failure

        raise FlatshareError(f"node record-analysis: the analysis was not recorded in {ctx.history_path} "
                             f"({describe_failure(err) if isinstance(err, OSError) else err})") from None
    print(dumps({"node": ctx.node, "recorded": bool(record)}, sort_keys=True))
    return 0


def _history_mark(ctx) -> str | None:
    """The newest history record's mark (node/history.py ``newest_mark``), None when the history cannot be read."""
    from ..errors import NodeStateError
    from .history import newest_mark
    from .records import read_history

    try:
        return newest_mark(read_history(ctx).records)
    except NodeStateError:
        return None


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: exit with :class:`Exit`'s code; an operator error is one line, never a traceback."""
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if args.command == "switch":
            code = switch(args)
        elif args.command == "status":
            from .status import node_status, switch_state

            ctx = _context(args)
            print(dumps(switch_state(ctx, args.switch) if args.switch else node_status(ctx), sort_keys=True))
            code = 0
        elif args.command == "history":
            from .records import read_history

            hist = read_history(_context(args))
            from .history import newest_mark

            print(dumps({"records": hist.records, "skipped": hist.skipped, "disorder": hist.disorder,
                         "newest": newest_mark(hist.records)}, sort_keys=True))
            code = 0
        elif args.command == "hold":
            from . import hold

            ctx = _context(args)
            code = 0
            if args.acquire is not None:
                answer = {"held": True, "hold": hold.acquire(ctx, args.acquire, args.who)}
            elif args.release:
                lifted = hold.release(ctx)
                answer = {"held": False, "lifted": lifted}
                code = 0 if lifted else int(Exit.NOTHING_TO_DO)
            else:
                current = hold.read_hold(ctx)
                answer = {"held": current is not None, "hold": current}
            print(dumps({"node": ctx.node, **answer}, sort_keys=True))
        elif args.command == "metrics":
            from .probe import engine_metrics

            print(dumps(engine_metrics(_context(args)), sort_keys=True))
            code = 0
        elif args.command == "answers":
            from .probe import engine_answers

            prompts = sys.stdin.buffer.read(1 << 20).decode("utf-8", errors="replace")  # 16 x 2000 characters fit
            print(dumps(engine_answers(_context(args), prompts, args.max_tokens, args.budget), sort_keys=True))
            code = 0
        elif args.command == "record-analysis":
            code = _record_analysis(args)
        elif args.command == "lock-check":
            from .lock_check import lock_check

            answer = lock_check(_context(args))
            print(dumps(answer, sort_keys=True))
            code = 0 if answer["ok"] else int(Exit.FAILED)
        elif args.command == "module":
            from .probe import built_module

            print(dumps(built_module(_context(args), args.path), sort_keys=True))
            code = 0
        else:
            from .probe import probe

            print(dumps(probe(_context(args)), sort_keys=True))
            code = 0
    except FlatshareError as err:
        print(f"flatshare-node: {err}", file=sys.stderr if args.command != "switch" else sys.stdout)
        code = err.exit_code
        if args.command != "switch":  # the switch's own Outcome says it; every other command answers this
            _emit(protocol.CommandError(int(code), str(err)))
    sys.exit(code)


if __name__ == "__main__":
    main()
