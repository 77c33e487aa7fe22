"""What holds the node's GPU memory, as ``nvidia-smi`` says (a node without it has nothing to ask).

vLLM issue 55510: a killed API server can leave its engine core holding the GPU, and the next engine then
runs out of memory at start. The switch starts a new engine only once no compute process holds the card
(:func:`compute_processes`), and says "not checked" where the node has no ``nvidia-smi``.
"""

from __future__ import annotations

import shutil
import subprocess

from ..errors import FlatshareError
from ..common.text import clip

#: nvidia-smi's bound (seconds).
NVIDIA_SMI_TIMEOUT_S = 10.0
#: The query: one line per compute process, ``PID, USED_MIB`` (nvidia-smi --help-query-compute-apps).
QUERY = ["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]


class GpuUnreadable(FlatshareError):
    """nvidia-smi is there but gave no answer that reads (exit status, timeout, another format)."""


def compute_processes(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> list[tuple[int, int]] | None:
    """The processes holding GPU memory: ``[(pid, MiB), ...]``, or None where there is no ``nvidia-smi``.

    Raises:
        GpuUnreadable: nvidia-smi failed, timed out or printed a line that is not ``PID, MIB``.
    """
    program = shutil.which("nvidia-smi")
    if program is None:
        return None
    try:
        done = subprocess.run([program, *QUERY], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise GpuUnreadable(f"nvidia-smi did not answer within {timeout_s:g} s") from None
    except OSError as err:
        raise GpuUnreadable(f"cannot run {program}: {err.strerror or err}") from None
    if done.returncode != 0:
        why = clip((done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1], 200)
        raise GpuUnreadable(f"nvidia-smi exited {done.returncode}: {why}")
    found = []
    for line in done.stdout.splitlines():
        if not line.strip():
            continue
        pid, _, used = line.partition(",")
        try:
            found.append((int(pid), int(float(used))))
        except ValueError:
            raise GpuUnreadable(f"nvidia-smi printed {line.strip()[:120]!r}, not 'PID, MiB'") from None
    return found
