"""One interface to a node, whatever carries it: this machine (:mod:`.local`) or SSH (:mod:`.ssh`).

As pyinfra's connectors do (docs/reference/engineering-style.md, "One
interface, several transports"), the rollout and the fleet commands talk to
"a node" through :class:`Connection`; whether it is this machine or one
reached over SSH is decided once, at the edge (:func:`.targets.connect`).
Tests add a fake one (tests/fake_connection.py) to unit-test the rollout's
decisions, beside the tests on the sandbox's real systemd and sshd.

Every read is bounded: :meth:`Session.lines` raises :class:`Silence` when the
node says nothing for ``silence_s`` seconds, and :class:`Lost` when the
connection drops; both name the bound or the cause.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from ..errors import TransportError


class Lost(TransportError):
    """The connection to the node dropped while a command ran."""


class Silence(TransportError):
    """The node said nothing for longer than the silence bound (a stalled connection or session)."""


@dataclass(frozen=True)
class CommandResult:
    """What a node-side command did: its exit status (None when it ended without one), its stdout, and its
    stderr apart (a node's shell may print there before the command runs: a login script, pyenv's rehash)."""

    status: int | None
    output: str
    errors: str = ""


class Session:
    """One node-side command in progress: its stdin, its combined stdout and stderr, its exit status."""

    node = "?"

    def send(self, data: bytes) -> None:
        """Write to the command's stdin.

        Raises:
            Lost: the connection is gone.
        """
        raise NotImplementedError

    def close_stdin(self) -> None:
        """Close the command's stdin (end of input)."""
        raise NotImplementedError

    def read(self, timeout_s: float) -> bytes | None:
        """Up to 64 KiB of output: ``b""`` at its end, None when nothing came within ``timeout_s``.

        Raises:
            Lost: the connection dropped.
        """
        raise NotImplementedError

    def exit_status(self, timeout_s: float) -> int | None:
        """The command's exit status once it ended, waiting at most ``timeout_s``; None without one."""
        raise NotImplementedError

    def errors(self) -> bytes:
        """What the command wrote to stderr so far, when it was started with stderr apart (else ``b""``)."""
        return b""

    def close(self) -> None:
        """Let go of the command (over SSH: close the channel; locally: stop reading it; it runs on)."""
        raise NotImplementedError

    def lines(self, silence_s: float) -> Iterator[str]:
        """The command's output, line by line, until it ends.

        Raises:
            Silence: nothing at all came for ``silence_s`` seconds.
            Lost: the connection dropped.
        """
        buffer = b""
        last = time.monotonic()
        while True:
            chunk = self.read(min(1.0, silence_s))
            now = time.monotonic()
            if chunk is None:
                if now - last >= silence_s:
                    raise Silence(f"{self.node}: the node said nothing for {silence_s:g} s (the silence bound); "
                                  "the connection or its session has stalled")
                continue
            last = now
            if chunk == b"":
                if buffer:
                    yield buffer.decode(errors="replace")
                return
            buffer += chunk
            while b"\n" in buffer:
                line, _, buffer = buffer.partition(b"\n")
                yield line.decode(errors="replace")


class Connection:
    """A way to run node-side commands on one node.

    Attributes:
        node: the node's name (for messages).
        identity: what tells this node from every other whatever name or address reached it (its SSH host
            key, ``TYPE BASE64``), or None when the transport has none (the node this command runs on).
    """

    node = "?"
    identity: str | None = None

    def start(self, argv: list[str], stderr_apart: bool = False) -> Session:
        """Start ``argv`` on the node (a program and its arguments, never a shell string).

        Args:
            stderr_apart: keep stderr out of what :meth:`Session.read` returns (:meth:`Session.errors`
                has it), for a command whose stdout is an answer to parse.

        Raises:
            TransportError: the node could not be reached.
        """
        raise NotImplementedError

    def run(self, argv: list[str], stdin: bytes = b"", timeout_s: float = 60.0) -> CommandResult:
        """Run ``argv`` to its end and collect its stdout and its stderr apart, bounded by ``timeout_s``
        seconds overall.

        Raises:
            Lost: its session ended without an exit status (the connection or the session on the node dropped,
                or a signal ended the command: RFC 4254 6.10 sends "exit-signal" then, not "exit-status"): no
                answer, which a read-only command's caller may ask for again.
            TransportError: unreachable, or no end within ``timeout_s`` (the message names the bound).
        """
        session = self.start(argv, stderr_apart=True)
        try:
            if stdin:
                session.send(stdin)
            session.close_stdin()
            deadline = time.monotonic() + timeout_s
            chunks = []
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"{self.node}: {argv[0]} did not finish within {timeout_s:g} s")
                chunk = session.read(min(left, 1.0))
                if chunk == b"":
                    break
                if chunk:
                    chunks.append(chunk)
            status = session.exit_status(max(0.1, deadline - time.monotonic()))
            if status is None:
                raise Lost(f"{self.node}: {argv[0]} ended without an exit status (its connection or its session on "
                           "the node dropped, or a signal ended it)")
            return CommandResult(status, b"".join(chunks).decode(errors="replace"),
                                 session.errors().decode(errors="replace"))
        finally:
            session.close()

    def close(self) -> None:
        """Close the connection."""
