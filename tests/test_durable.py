"""The node's write primitives (common/durable.py) on a real filesystem that fills: a tmpfs of its own."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from flatshare_ops.common import durable


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 64 KiB tmpfs at tmp_path/disk, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _leave_free(disk: Path, size: int) -> None:
    """Fill the disk but for ``size`` bytes (fallocate(1) takes the rest)."""
    info = os.statvfs(disk)
    subprocess.run(["fallocate", "-l", str(info.f_bavail * info.f_frsize - size), str(disk / "filler")], check=True)


def test_a_record_the_disk_fills_in_the_middle_of_is_not_kept_at_all(small_disk):
    # A breaker's case: write(2) wrote the page that was left of a 10 KB record and returned the count; the
    # record stayed torn, reported as written, and every reader skipped it as damage from then on.
    history = small_disk / "history.jsonl"
    history.write_bytes(b'{"schema": 2, "result": "released"}\n' * 3)
    before = history.read_bytes()
    _leave_free(small_disk, 4096)
    with pytest.raises(OSError) as failed:
        durable.append_line(history, '{"analysis": "' + "x" * 10_000 + '"}')
    assert failed.value.errno == 28  # ENOSPC
    assert history.read_bytes() == before
    (small_disk / "filler").unlink()
    durable.append_line(history, '{"schema": 2, "result": "analysed"}')  # room again: whole, after the others
    assert history.read_bytes() == before + b'{"schema": 2, "result": "analysed"}\n'
