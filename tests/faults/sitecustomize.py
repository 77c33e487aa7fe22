"""Fault injection for the node's side, loaded by Python at start when tests/faults is on PYTHONPATH.

The package carries no test seams: a test starts a release with
``PYTHONPATH=tests/faults`` and ``FLATSHARE_TEST_FAULTS`` set to JSON, and
this file wraps the package's functions in the node-side process only
(``python -m flatshare_ops.node`` or ``flatshare-node``; in the modules of the switcher the entry point
runs too):

- ``{"kill_after_step": STEP}``: SIGKILL the switch right after STEP is journaled done
  (``record-history``: the history record is written, the journal not yet removed);
- ``{"fail": PRIMITIVE, "nth": N, "errno": "ENOSPC"}``: the Nth call of a durable-write
  primitive (``write_atomic``, ``append_line``, ``rename``, ``replace_symlink``, ``remove``, or
  ``any``: every primitive counted together) raises OSError(errno) instead of writing.
- ``{"sleep_in_step": STEP, "seconds": S}``: the step waits S seconds first (to send signals during it);
  with ``"until": PATH`` it waits only until PATH exists (at most S seconds): the test ends the wait when
  it has done what it does during the step, however long that took.
- ``{"bug_in_plan": true}``: planning raises RuntimeError, as a bug before any step would.
- ``{"wait_in_prune": S}``: the prune at the end of a switch (of old releases and switchers) waits S
  seconds before it removes anything, as a prune of much takes a while (to send signals during it).
- ``{"auto_rollback_journal_fails": ERRNO}``: an automatic rollback's journal cannot be written (a disk that
  filled, or became read-only, after the failed switch was recorded).
- ``{"signal_in_auto_rollback_step": STEP, "signal": SIGNAL}``: the node's switch is sent SIGNAL as an automatic
  rollback's STEP begins.
- ``{"signal_after_job": "VERB UNIT", "signal": SIGNAL}``: the node's switch is sent SIGNAL as soon as its
  switch's systemd job VERB on UNIT is done (``stop flatshare-engine.service``: between the engine's stop and
  its start).
- ``{"signal_at_auto_rollback": SIGNAL}``: the node's switch is sent SIGNAL as it hands over to its automatic
  rollback (after the failed switch is recorded, before the rollback's first write).
- ``{"slow_command": COMMAND, "seconds": S, "until": PATH}``: a node command COMMAND (``history``...) waits at its
  start until PATH exists, at most S seconds (the retry guard's history reads, held while a switch asks its
  go-ahead).
- ``{"announce": COMMAND, "at": PATH}``: a node command COMMAND appends its command line (one line) to PATH as it
  exits, so that a test waits for that command to have answered (the retry guard's history read of a node).
"""

import json
import os
import sys

_SPEC = os.environ.get("FLATSHARE_TEST_FAULTS")
_ARGV = " ".join(getattr(sys, "orig_argv", sys.argv))


def _install(spec: dict) -> None:
    import errno
    import signal
    import time

    from flatshare_ops.common import durable
    from flatshare_ops.node import journal, steps, switch

    if "kill_after_step" in spec:
        step = spec["kill_after_step"]
        mark = journal.mark

        def mark_then_kill(state_dir, j, name, state, error=None):
            mark(state_dir, j, name, state, error)
            if name == step and state == "done":
                os.kill(os.getpid(), signal.SIGKILL)

        journal.mark = mark_then_kill

    if "fail" in spec:
        names = ("write_atomic", "append_line", "rename", "replace_symlink", "remove")
        wanted = names if spec["fail"] == "any" else (spec["fail"],)
        count = {"n": 0}
        code = getattr(errno, spec.get("errno", "ENOSPC"))

        def wrap(name, original):
            def failing(*args, **kwargs):
                count["n"] += 1
                if count["n"] == int(spec["nth"]):
                    target = args[0] if args else None
                    raise OSError(code, os.strerror(code), str(target) if target is not None else None)
                return original(*args, **kwargs)

            return failing

        for name in wanted:
            setattr(durable, name, wrap(name, getattr(durable, name)))

    if spec.get("bug_in_plan"):
        def buggy(*_args, **_kwargs):
            raise RuntimeError("injected bug")

        switch.plan = buggy

    if "wait_in_prune" in spec:
        prune = switch.prune

        def slow_prune(*args, **kwargs):
            time.sleep(float(spec["wait_in_prune"]))  # a signal's handler raises here as inside the prune
            return prune(*args, **kwargs)

        switch.prune = slow_prune

    if "auto_rollback_journal_fails" in spec:
        write_journal = journal.write_journal
        code = getattr(errno, spec["auto_rollback_journal_fails"])

        def failing_for_the_rollback(state_dir, j):
            if j.auto:
                raise OSError(code, os.strerror(code), str(state_dir))
            return write_journal(state_dir, j)

        journal.write_journal = failing_for_the_rollback

    if "signal_at_auto_rollback" in spec:
        roll_back = switch._roll_back_automatically
        sig = getattr(signal, spec["signal_at_auto_rollback"])

        def signalled(*args, **kwargs):
            os.kill(os.getpid(), sig)
            return roll_back(*args, **kwargs)

        switch._roll_back_automatically = signalled

    if "signal_in_auto_rollback_step" in spec:
        target = steps.STEP_BY_NAME[spec["signal_in_auto_rollback_step"]]
        begin = target.run
        sig = getattr(signal, spec.get("signal", "SIGTERM"))

        def signalled_step(sw):
            if sw.journal is not None and sw.journal.auto:
                os.kill(os.getpid(), sig)
            begin(sw)

        object.__setattr__(target, "run", signalled_step)

    if "signal_after_job" in spec:
        verb_unit = spec["signal_after_job"]
        job = steps.Switch.job
        after = getattr(signal, spec.get("signal", "SIGTERM"))

        def job_then_signal(self, verb, unit, timeout_s):
            job(self, verb, unit, timeout_s)
            if f"{verb} {unit}" == verb_unit:
                os.kill(os.getpid(), after)

        setattr(steps.Switch, "job", job_then_signal)  # the fault: Switch.job replaced on the class

    if "sleep_in_step" in spec:
        step = steps.STEP_BY_NAME[spec["sleep_in_step"]]
        run = step.run

        def slow(sw):
            _wait(float(spec["seconds"]), spec.get("until"))
            run(sw)

        object.__setattr__(step, "run", slow)


def _wait(seconds: float, until: str | None) -> None:
    """Wait ``seconds``, or less once the file ``until`` exists."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (until and os.path.exists(until)):
        time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))


if _SPEC and ("flatshare_ops.node" in _ARGV or "flatshare-node" in _ARGV):
    _spec = json.loads(_SPEC)
    _argv = list(getattr(sys, "orig_argv", sys.argv))
    _command = _argv[_argv.index("flatshare_ops.node") + 1:][:1] if "flatshare_ops.node" in _argv else []
    if "slow_command" in _spec and _command == [_spec["slow_command"]]:
        _wait(float(_spec["seconds"]), _spec["until"])
    if "announce" in _spec and _command == [_spec["announce"]]:
        import atexit

        def _announce(path: str = _spec["at"], line: str = " ".join(_argv)) -> None:
            with open(path, "a") as told:
                told.write(line + "\n")

        atexit.register(_announce)
    _install(_spec)
    if "flatshare-node" in _ARGV:
        # The entry point runs a shipped switcher in this process, every flatshare_ops module imported again from
        # its zip (node/entry.py _use): the faults are put into those modules too.
        from flatshare_ops.node import entry as _entry

        def _use_with_faults(switcher, use=_entry._use):
            use(switcher)
            if switcher is not None:
                _install(_spec)

        _entry._use = _use_with_faults
