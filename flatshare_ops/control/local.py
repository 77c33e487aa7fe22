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
        assert process.stdout is not None  # LocalConnection opens it with stdout=PIPE
        self._fd = process.stdout.fileno()
        self._err_fd = process.stderr.fileno() if process.stderr is not None else None
        self._err = bytearray()

    def send(self, data: bytes) -> None:
        assert self.process.stdin is not None  # stdin=PIPE
        try:
            self.process.stdin.write(data)
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise Lost(f"{self.node}: the node-side command closed its input") from None

    def close_stdin(self) -> None:
        assert self.process.stdin is not None  # stdin=PIPE
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def read(self, timeout_s: float) -> bytes | None:
        # stderr apart is drained as it comes, so that a child writing much there never blocks on a full pipe.
        fds = [self._fd] + ([self._err_fd] if self._err_fd is not None else [])
        ready, _, _ = select.select(fds, [], [], max(0.0, timeout_s))
        if self._err_fd is not None and self._err_fd in ready:
            chunk = os.read(self._err_fd, 65536)
            self._err += chunk
            if not chunk:
                self._err_fd = None
        if self._fd not in ready:
            return None
        return os.read(self._fd, 65536)

    def exit_status(self, timeout_s: float) -> int | None:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def errors(self) -> bytes:
        while self._err_fd is not None:  # what is left once the command ended
            ready, _, _ = select.select([self._err_fd], [], [], 1.0)
            chunk = os.read(self._err_fd, 65536) if ready else b""
            self._err += chunk
            if not chunk:
                self._err_fd = None
        return bytes(self._err)

    def close(self) -> None:
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is None:
                continue
            try:
                stream.close()
            except OSError:
                pass


class LocalConnection(Connection):
    """The node this command runs on."""

    def __init__(self, node: str) -> None:
        self.node = node

    def start(self, argv: list[str], stderr_apart: bool = False) -> LocalSession:
        try:
            process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE if stderr_apart else subprocess.STDOUT,
                                       start_new_session=True)
        except OSError as err:
            raise TransportError(f"{self.node}: cannot start {argv[0]}: {err.strerror or err}") from None
        return LocalSession(self.node, process)
