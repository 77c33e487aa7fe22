"""For the tests only: the operator's process sends itself SIGTERM at a moment a test could not time from outside.

``FLATSHARE_TEST_SIGNAL_AT`` (comma-separated) names the moments: ``exit`` (at the interpreter's exit, after
``main``), ``import:MODULE`` (as MODULE is first imported), or a :class:`flatshare_ops.control.rollout.Rollout`
method, at the start of each call (``NAME``), of its Nth call only (``NAME#N``), or of a call about a node (its
first argument) whose last progress said PHASE (``NAME@PHASE``, a :class:`flatshare_ops.common.protocol.SwitchPhase`
value). ``NAME!both`` sends SIGINT and SIGTERM at once (both pending when Python runs its handlers: SIGINT's first).
``late`` sends SIGTERM as the interpreter clears its modules, past ``atexit``; ``call:MODULE.FUNCTION`` at the start of each
call of that function (looked up on its module at call time). Put on ``PYTHONPATH`` by
tests/conftest.py ``signal_at``; a process the variable does not name a method for imports nothing of the package.
"""

import os
import signal
import sys


def _install(moments: list[str]) -> None:
    import atexit

    if "exit" in moments:
        atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))
    if "late" in moments:
        class Late:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGTERM)

        globals()["_late"] = Late()  # collected with this module's globals, as the interpreter clears modules
    imported = {m.removeprefix("import:") for m in moments if m.startswith("import:")}
    if imported:
        class Signal:  # a finder that finds nothing: the import goes on, the signal arrives during it
            @staticmethod
            def find_spec(name, path=None, target=None):
                if name in imported:
                    imported.discard(name)
                    os.kill(os.getpid(), signal.SIGTERM)
                return None

        sys.meta_path.insert(0, Signal)
    for moment in moments:
        if moment.startswith("call:"):
            import importlib

            module_name, _, function_name = moment.removeprefix("call:").rpartition(".")
            module = importlib.import_module(module_name)

            def called(*args, _function=getattr(module, function_name), **kwargs):
                os.kill(os.getpid(), signal.SIGTERM)
                return _function(*args, **kwargs)

            setattr(module, function_name, called)
    methods = [m for m in moments if m not in ("exit", "late") and not m.startswith(("import:", "call:"))]
    if not methods:
        return
    from flatshare_ops.control import rollout

    def send(both: bool) -> None:
        if not both:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    for moment in methods:
        moment, _, how = moment.partition("!")
        moment, _, phase = moment.partition("@")
        name, _, nth = moment.partition("#")
        method, calls = getattr(rollout.Rollout, name), [0]

        def signalled(self, *args, _method=method, _nth=int(nth or 0), _phase=phase, _calls=calls,
                      _both=how == "both", **kwargs):
            _calls[0] += 1
            stands = self.progress.get(args[0].name) if _phase and args else None
            if (not _nth or _calls[0] == _nth) and (not _phase or (stands is not None and stands.phase == _phase)):
                send(_both)
            return _method(self, *args, **kwargs)

        setattr(rollout.Rollout, name, signalled)


if os.environ.get("FLATSHARE_TEST_SIGNAL_AT") and "flatshare-node" not in " ".join(getattr(sys, "orig_argv", sys.argv)):
    _install([m for m in os.environ["FLATSHARE_TEST_SIGNAL_AT"].split(",") if m])
