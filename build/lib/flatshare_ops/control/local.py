"""This machine as a node: the node-side command runs as a child process, exactly as over SSH.

The child starts in a session of its own, so that Ctrl-C at the operator's
terminal reaches only the operator's side: a node never stops mid-switch
because the operator pressed Ctrl-C (the node's own SIGTERM handling is the
early-end rule). Closing the session only stops reading; the child runs on,
as a node-side command does when an SSH connection drops.
"""

from __future__ import annotations

import os
import select
import subprocess

from ..errors import TransportError
from .connection import Connection, Lost, Session


class LocalSession(Session):
    """A node-side command running as a child process of this one."""

    def __init__(self, node: str, process: subprocess.Popen) -> None:
        self.node, self.process = node, process
        self._fd = process.stdout.fileno()

    def send(self, data: bytes) -> None:
        try:
            self.process.stdin.write(data)
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise Lost(f"{self.node}: the node-side command closed its input") from None

    def close_stdin(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def read(self, timeout_s: float) -> bytes | None:
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout_s))
        if not ready:
            return None
        return os.read(self._fd, 65536)

    def exit_status(self, timeout_s: float) -> int | None:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


class LocalConnection(Connection):
    """The node this command runs on."""

    def __init__(self, node: str) -> None:
        self.node = node

    def start(self, argv: list[str]) -> LocalSession:
        try:
            process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        except OSError as err:
            raise TransportError(f"{self.node}: cannot start {argv[0]}: {err.strerror or err}") from None
        return LocalSession(self.node, process)
