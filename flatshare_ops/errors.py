"""The exit-code table and the error classes every command raises.

Every error an operator can meet (bad profile, damaged node file, unreachable
node, missing unit) is raised as a :class:`FlatshareError` whose message
already reads like a colleague's note: the place, the rule, the way out
(docs/reference/engineering-style.md). The command line prints it as one line
and exits with the class's code from :class:`Exit`. Standard library only, and
nothing of the package: serving-check and the node side import this module
(what each code means in a summary, in the protocol's words, is
control/summary.py's ``EXIT_NAMES``).

serving-check is the exception: it exits with the Nagios plugin codes
(:mod:`flatshare_ops.check.report`), never with these.
"""

from __future__ import annotations

from enum import IntEnum



class Exit(IntEnum):
    """Exit codes of ``flatshare`` and ``flatshare-node`` (README.md, "Exit codes")."""

    OK = 0  # released, or the command did what it was asked
    FAILED = 1  # a release failed mid-switch (journal kept); drift; a failed verification
    BAD_INPUT = 2  # a malformed profile, inventory, bundle or option
    REFUSED = 3  # the command would not start: lock held, E2 drop-ins, admission, preflight
    NOTHING_TO_DO = 4  # the node already runs what was asked, and serves
    DAMAGED = 5  # a node file is damaged (journal, history, current link, lock record...)
    UNREACHABLE = 6  # the node could not be reached, or the connection was lost with no answer
    STILL_SWITCHING = 7  # the connection was lost and the node was still switching when last asked
    SYSTEMD = 8  # the node's systemd manager did not answer
    ROLLED_BACK = 9  # the new release did not serve: the node rolled itself back to what served (a rollout stops)
    ANALYSIS_FAILED = 10  # the canary's analysis failed: the canary rolled back, the rollout stopped
    PAUSED = 11  # the canary's analysis was inconclusive and the profile says pause: the canary stays, the rollout stopped
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
    OUTPUT_CLOSED = 141  # what read the output went away (128 + SIGPIPE, as a shell's pipeline ends its writers)
    TERMINATED = 143  # SIGTERM (128 + SIGTERM)


class OperatorInterrupted(BaseException):
    """Ctrl-C or SIGTERM reached the operator's side (``code``: :attr:`Exit.INTERRUPTED` or
    :attr:`Exit.TERMINATED`); nodes are left to finish what they do. ``said``: what it stopped before, when the
    command knows (``flatshare`` prints it), else None. A BaseException, as KeyboardInterrupt is: no
    ``except Exception`` takes it for an error of its own."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code
        self.said: str | None = None


class FlatshareError(Exception):
    """An operator-facing error: ``str(err)`` is the whole one-line message.

    ``exit_code`` is what the command line exits with (bad input unless a
    subclass says otherwise).
    """

    exit_code: int = Exit.BAD_INPUT


class ProfileError(FlatshareError):
    """A profile or inventory file is missing, malformed, or breaks a schema rule."""


class Refused(FlatshareError):
    """The command will not start; nothing was changed (or only calls were given back).

    ``waits_for``: why, for a refusal waiting may end (a common/protocol.py ``RefusedFor``); else None."""

    exit_code = Exit.REFUSED

    def __init__(self, message: str = "", waits_for: str | None = None) -> None:
        super().__init__(message)
        self.waits_for = waits_for


class SwitchFailed(FlatshareError):
    """A switch stopped early; its journal is kept and the next release finishes it."""

    exit_code = Exit.FAILED


class WriteFailed(FlatshareError):
    """A file of the checkout could not be written (a full disk, a read-only filesystem, something other than a
    file in its place): the message names it and why; nothing was changed."""

    exit_code = Exit.FAILED


class NodeStateError(FlatshareError):
    """A file the node keeps is damaged: the message names the file, the damage and what to do."""

    exit_code = Exit.DAMAGED


class TransportError(FlatshareError):
    """A node could not be reached over SSH, or the connection failed with no answer from the node."""

    exit_code = Exit.UNREACHABLE


class SystemdError(FlatshareError):
    """The node's systemd manager could not be reached, did not answer in time, or refused a request."""

    exit_code = Exit.SYSTEMD
