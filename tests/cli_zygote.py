"""The operator's commands for the tests, each in a process of its own forked from one that imported them once.

A ``flatshare`` or ``serving-check`` started afresh spends about half a second of CPU importing (typer, pydantic,
paramiko, jinja2, tomlkit) before it does anything, and the tests start one over and over. So each
test process keeps a zygote (as Android's and as CPython's own forkserver): a process that has imported the
console scripts' modules and nothing more (no thread, no socket but its own, no call into the package), and forks
for each command. The fork is a real process of its own (its own PID, exit code, signals, file descriptors, working
directory and environment, its stdout and stderr the test's), running the same ``main`` the console script runs:
only the imports are shared.

:func:`run` stands in for ``subprocess.run`` (tests/conftest.py puts it there) for those two programs only, when
nothing asks for what a fork cannot give: an environment whose ``PYTHON*`` variables differ from the test
process's (the interpreter read them at its start), or an argument it does not know; everything else, and every
``Popen``, starts a fresh process as before. ``FLATSHARE_TEST_FRESH=1`` starts every command afresh (to check that
nothing depends on the zygote).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

BIN = Path(sys.executable).parent
#: program -> the module and function its console script runs (pyproject.toml's [project.scripts]).
PROGRAMS = {"flatshare": ("flatshare_ops.cli", "main"), "serving-check": ("flatshare_ops.check.cli", "main")}
#: What the zygote imports before it forks anything: the console scripts' modules and what their commands import
#: in their functions (importing a module earlier changes nothing it does).
WARM = ("flatshare_ops.cli", *(f"flatshare_ops.cli.{m}" for m in ("profiles", "reports", "sandbox", "nodes", "hold", "release")),
        "flatshare_ops.check.cli", "flatshare_ops.control.rollout", "flatshare_ops.render.checkout",
        "flatshare_ops.config.profile", "flatshare_ops.control.ssh", "paramiko", "pydantic", "jinja2", "tomlkit")
KNOWN = {"capture_output", "text", "universal_newlines", "encoding", "errors", "env", "cwd", "timeout", "stdin",
         "stdout", "stderr", "input", "check"}

ZYGOTE = r'''
import array, atexit, importlib, json, os, select, signal, socket, sys, traceback
listener = socket.socket(fileno=int(sys.argv[1]))
parent = int(sys.argv[2])
programs = json.loads(sys.argv[3])
for name in json.loads(sys.argv[4]):
    importlib.import_module(name)
sys.stdout.flush(); sys.stderr.flush()
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its waiters reap themselves
os.write(1, b"ready\n")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing more goes to the test process's pipe
while True:
    readable, _, _ = select.select([listener, parent], [], [])
    if parent in readable:
        os._exit(0)  # the test process ended
    connection, _ = listener.accept()
    if os.fork():
        connection.close()
        continue
    # the waiter: starts the command, says its PID, waits for it and says how it ended
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    listener.close(); os.close(parent)
    message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)  # the descriptors come with the first bytes
    while len(message) < 8 or len(message) < 8 + int.from_bytes(message[:8], "big"):
        more = connection.recv(1 << 16)
        if not more:
            os._exit(1)
        message += more
    request = json.loads(message[8:])
    pid = os.fork()
    if pid == 0:
        connection.close()
        for number, fd in enumerate(fds):
            os.dup2(fd, number)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["argv0"], *request["args"]]
        sys.orig_argv = [sys.executable, *sys.argv]
        code = 0
        try:
            module, function = programs[request["program"]]
            getattr(importlib.import_module(module), function)()
        except SystemExit as stop:
            if stop.code is None:
                code = 0
            elif isinstance(stop.code, int):
                code = stop.code
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        try:
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code & 0xFF)
    for fd in fds:
        os.close(fd)
    try:
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        connection.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    except OSError:
        pass  # the test gave up on it (a timeout): nobody to tell
    os._exit(0)
'''

_zygote: dict = {}  # "path": its socket's path, "process": it, "pid": the test process that started it
_lock = threading.Lock()
_real_run = subprocess.run


def _start() -> str:
    with _lock:
        if _zygote.get("pid") == os.getpid() and _zygote["process"].poll() is None:
            return _zygote["path"]
        directory = tempfile.mkdtemp(prefix="flatshare-zygote-")
        path = os.path.join(directory, "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(64)
        read_end, write_end = os.pipe()  # closed when this process ends: the zygote then ends too
        process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(listener.fileno()), str(read_end), json.dumps(PROGRAMS), json.dumps(WARM)],
            pass_fds=(listener.fileno(), read_end), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        listener.close()
        os.close(read_end)
        assert process.stdout is not None
        if process.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the CLI zygote did not start (exit {process.wait()})")
        _zygote.update(path=path, process=process, pid=os.getpid(), keep=write_end)
        atexit.register(shutil.rmtree, directory, True)
        return path


def _forkable(args, kwargs) -> str | None:
    """The program the zygote runs for this call, or None (a fresh process)."""
    if os.environ.get("FLATSHARE_TEST_FRESH") == "1" or not isinstance(args, (list, tuple)) or not args:
        return None
    first = os.fsdecode(args[0])
    program = os.path.basename(first)
    if program not in PROGRAMS or Path(first).parent != BIN or set(kwargs) - KNOWN:
        return None
    if not all(isinstance(a, (str, bytes, os.PathLike)) for a in args):
        return None
    env = kwargs.get("env")
    if env is not None:
        python = lambda e: {k: v for k, v in e.items() if k.startswith("PYTHON")}  # noqa: E731
        if python(env) != python(os.environ):
            return None
    return program


def _fd(spec, default: int, opened: list, mode: int) -> int:
    if spec is None:
        return default
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, mode)
        opened.append(fd)
        return fd
    if isinstance(spec, int):
        return spec
    return spec.fileno()


def run(*popenargs: Any, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run``, through this test process's zygote for ``flatshare`` and ``serving-check`` (see above)."""
    args = popenargs[0] if popenargs else kwargs.get("args")
    rest = {k: v for k, v in kwargs.items() if k != "args"}
    program = _forkable(args, rest) if len(popenargs) <= 1 else None
    if program is None:
        return _real_run(*popenargs, **kwargs)
    return _forked(program, list(args or ()), rest)


def _forked(program: str, args: list, rest: dict[str, Any]) -> subprocess.CompletedProcess:
    text = bool(rest.get("text") or rest.get("universal_newlines") or rest.get("encoding") or rest.get("errors"))
    capture = rest.get("capture_output", False)
    opened: list[int] = []
    files: dict[str, IO[bytes]] = {}
    try:
        if rest.get("input") is not None:
            data = rest["input"]
            stdin_file = tempfile.TemporaryFile()
            stdin_file.write(data.encode(rest.get("encoding") or "utf-8") if isinstance(data, str) else data)
            stdin_file.seek(0)
            files["stdin"] = stdin_file
            stdin = stdin_file.fileno()
        else:
            stdin = _fd(rest.get("stdin"), 0, opened, os.O_RDONLY)
            try:
                os.fstat(stdin)
            except OSError:  # this process has no stdin: the command reads an empty one
                stdin = _fd(subprocess.DEVNULL, 0, opened, os.O_RDONLY)
        outs = []
        for name, default in (("stdout", 1), ("stderr", 2)):
            spec = rest.get(name)
            if capture or spec == subprocess.PIPE:
                files[name] = tempfile.TemporaryFile()
                outs.append(files[name].fileno())
            elif name == "stderr" and spec == subprocess.STDOUT:
                outs.append(outs[0])
            else:
                outs.append(_fd(spec, default, opened, os.O_WRONLY))
        argv = [os.fsdecode(a) for a in args]
        request = {"program": program, "argv0": argv[0], "args": argv[1:],
                   "cwd": os.fsdecode(rest.get("cwd") or os.getcwd()),
                   "env": {os.fsdecode(k): os.fsdecode(v) for k, v in (rest.get("env") or os.environ).items()}}
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(_start())
            data = json.dumps(request).encode()
            data = len(data).to_bytes(8, "big") + data  # a stream: the length first, then the request, whole
            sent = socket.send_fds(connection, [data], [stdin, *outs])
            connection.sendall(data[sent:])
            answers = connection.makefile("rb")
            pid = json.loads(answers.readline())["pid"]
            connection.settimeout(rest.get("timeout"))
            try:
                line = answers.readline()
            except TimeoutError:
                os.kill(pid, 9)
                raise subprocess.TimeoutExpired(args, rest["timeout"], _read(files.get("stdout")),
                                                _read(files.get("stderr"))) from None
            if not line:
                raise RuntimeError(f"the CLI zygote's waiter for {argv} ended without an answer")
            code = json.loads(line)["status"]
        finally:
            connection.close()
        out, err = _read(files.get("stdout")), _read(files.get("stderr"))
        result: subprocess.CompletedProcess[Any] = subprocess.CompletedProcess(args, code, out, err)
        if text:
            encoding, errors = rest.get("encoding") or "utf-8", rest.get("errors") or "strict"
            result.stdout, result.stderr = _decoded(out, encoding, errors), _decoded(err, encoding, errors)
        if rest.get("check"):
            result.check_returncode()
        return result
    finally:
        for fd in opened:
            os.close(fd)
        for f in files.values():
            f.close()


def _read(f: IO[bytes] | None) -> bytes | None:
    if f is None:
        return None
    f.seek(0)
    return f.read()


def _decoded(data: bytes | None, encoding: str, errors: str) -> str | None:
    """``data`` as text mode reads it: decoded, with universal newlines (io.TextIOWrapper's)."""
    return None if data is None else data.decode(encoding, errors).replace("\r\n", "\n").replace("\r", "\n")
