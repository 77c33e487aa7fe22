"""Whether reading the release lock works on this node's filesystem (``flatshare doctor``; adr/0011).

A child process takes a lock as a release does (:func:`.lock.lock_directory`
on a scratch directory in the state directory, so on the same filesystem and
mount, and filelock's ``FileLock`` on a file in it, as on ``releases/.lock``);
this process reads both from the kernel's lock table (common/locks.py) and
must find them held by the child's pid; the child lets go, and both must read
free. Every wait is bounded; the scratch directory is removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..common.locks import LockTableError, held_by
from .context import NodeContext

#: How long the child may take to take its locks, and to let go of them (seconds).
CHILD_S = 10.0

_CHILD = ("import sys; sys.path.insert(0, sys.argv[1]); from flatshare_ops.node.lock_check import child; "
          "child(sys.argv[2])")


def child(scratch: str) -> None:
    """The child's part: lock ``scratch`` (a directory) and ``scratch/file``, say ``locked``, hold them until
    stdin closes (bounded by :data:`CHILD_S`), then exit (the kernel releases both)."""
    import select

    from filelock import FileLock

    from .lock import lock_directory

    fd = lock_directory(scratch)
    file_lock = FileLock(str(Path(scratch) / "file"))
    file_lock.acquire(timeout=0)
    print("locked" if fd is not None else "not locked", flush=True)
    select.select([sys.stdin], [], [], CHILD_S)


def filesystem(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (``ext4``, ``btrfs``, ``overlay``...), from
    ``/proc/self/mountinfo`` (the field after `` - ``, proc(5)); ``unknown`` when it does not say."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                mount = next(line.split()[1] for line in f if line.startswith("mnt_id:"))
        finally:
            os.close(fd)
        with open("/proc/self/mountinfo") as f:
            for line in f:
                if line.split(" ", 1)[0] == mount:
                    return line.split(" - ", 1)[1].split()[0]
    except (OSError, StopIteration, IndexError):
        pass
    return "unknown"


def lock_check(ctx: NodeContext) -> dict:
    """Take a lock in a child, read it, release it, read it again.

    Returns:
        ``{"node", "ok": bool, "filesystem", "detail"}``: ``detail`` says what was read (or what failed).
    """
    base = Path(ctx.state_dir)
    kind = filesystem(base)
    try:
        scratch = Path(tempfile.mkdtemp(prefix=".lock-check-", dir=base))
    except OSError as err:
        return {"node": ctx.node, "ok": False, "filesystem": kind,
                "detail": f"cannot make a scratch directory in {base} ({err.strerror or err})"}
    try:
        ok, detail = _exercise(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"node": ctx.node, "ok": ok, "filesystem": kind, "detail": f"{base} ({kind}): {detail}"}


def _exercise(scratch: Path) -> tuple[bool, str]:
    package = str(Path(__file__).resolve().parent.parent.parent)
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, package, str(scratch)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None  # all three PIPE
    try:
        import select

        ready, _, _ = select.select([proc.stdout], [], [], CHILD_S)
        said = proc.stdout.readline().strip() if ready else ""
        if said != "locked":
            heard = said or (proc.stderr.read(400).strip() if proc.poll() is not None else "") or "no answer"
            return False, f"the child did not take its locks within {CHILD_S:g} s ({heard})"
        try:
            held = {"directory": held_by(scratch), "file": held_by(scratch / "file")}
        except LockTableError as err:
            return False, f"the lock table cannot be read here: {err}"
        wrong = [f"the {what} lock read as {'free' if pid is None else f'held by pid {pid}'}"
                 for what, pid in held.items() if pid != proc.pid]
        proc.stdin.close()
        proc.wait(CHILD_S)
        after = {"directory": held_by(scratch), "file": held_by(scratch / "file")}
        wrong += [f"the {what} lock still read as held by pid {pid} after the child exited"
                  for what, pid in after.items() if pid is not None]
        if wrong:
            return False, (f"a child (pid {proc.pid}) took a lock on a directory and a file, and " + "; ".join(wrong)
                           + ": 'is a release running here' cannot be told on this filesystem")
        return True, (f"a lock a child took on a directory and on a file read as held by its pid {proc.pid}, and "
                      "as free once it let go")
    except subprocess.TimeoutExpired:
        return False, f"the child did not let go of its locks within {CHILD_S:g} s"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

