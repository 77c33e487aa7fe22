"""The node's writes on real filesystems that fill or turn read-only (a tmpfs of its own): the durable
primitives (common/durable.py) and the records written through them."""

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


def _record_analysis(state_dir: Path, document: str) -> subprocess.CompletedProcess:
    import sys

    return subprocess.run([sys.executable, "-m", "flatshare_ops.node", "record-analysis", "--node", "cyan",
                           "--state-dir", str(state_dir), "--switch", "abcd1234abcd1234", "--rollout", "r1"],
                          input=document, capture_output=True, text=True, timeout=60)


def _analysis(start_s: float, detail: object = None) -> str:
    import json

    return json.dumps({"summary": "analysis of canary cyan: passed", "measurements": [
        {"canary": {"start_s": start_s}, **({"detail": detail} if detail is not None else {})}]})


@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_an_analysis_the_node_cannot_write_is_one_line_naming_the_file_and_why(small_disk, disk):
    # A breaker's cases: a full, read-only or immutable releases/ gave record-analysis a traceback (OSError).
    import json
    import time

    history = small_disk / "releases/history.jsonl"
    history.parent.mkdir()
    history.write_bytes(b"")
    if disk == "full":
        _leave_free(small_disk, 0)
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    done = _record_analysis(small_disk, _analysis(time.time(), "x" * 9000))
    said = done.stderr.strip().splitlines()  # for a person: one line
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert len(said) == 1 and str(history) in said[0], said
    assert ("ENOSPC" if disk == "full" else "EROFS") in said[0], said
    (answer,) = done.stdout.strip().splitlines()  # for the operator's side: the same, as fields
    error = json.loads(answer.removeprefix("::flatshare:error "))
    assert error == {"code": done.returncode, "message": said[0].removeprefix("flatshare-node: ")}, error
    assert history.read_bytes() == b""


def test_an_analysis_from_an_operator_whose_clock_runs_ahead_is_recorded_in_the_nodes_order(tmp_path):
    # A breaker's case: a start_s 600 s ahead of the node's clock gave a traceback (a record its reader skips).
    import json
    import time

    (tmp_path / "releases").mkdir()
    done = _record_analysis(tmp_path, _analysis(time.time() + 600))
    assert done.returncode == 0 and json.loads(done.stdout)["recorded"] is True, done.stdout + done.stderr
    (record,) = [json.loads(line) for line in (tmp_path / "releases/history.jsonl").read_text().splitlines()]
    assert record["started_at"] <= record["finished_at"] and record["duration_s"] == 0


def test_an_analysis_nested_too_deeply_for_the_nodes_answers_is_refused_and_history_still_answers(tmp_path):
    # A breaker's case: a document nested 31 levels was written; `history` and `status` then could not answer
    # (they carry each record two levels down, past the 32 every document is read within).
    import json
    import sys
    import time

    (tmp_path / "releases").mkdir()
    deep: object = 1
    for _ in range(27):
        deep = [deep]
    done = _record_analysis(tmp_path, _analysis(time.time(), deep))
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "nested more than 28 levels" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    listed = subprocess.run([sys.executable, "-m", "flatshare_ops.node", "history", "--node", "cyan", "--state-dir",
                             str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and json.loads(listed.stdout)["records"] == [], listed.stdout + listed.stderr


# --- history.jsonl never grows past what its reader takes -----------------------------------------------------


def _record(node: str, n: int, pad: int = 900) -> dict:
    now = 1_800_000_000.0 + n
    return {"switch": f"s{n:07d}", "rollout": None, "node": node, "kind": "release", "result": "released",
            "step": None, "reason": "x" * pad, "before": None, "after": f"r{n}", "target": f"r{n}", "served": True,
            "started_at": now, "finished_at": now, "duration_s": 0.0, "resumed": 0}


def test_a_switchs_record_compacts_a_full_history_and_every_line_stays_in_one_file_or_the_other(tmp_path):
    # A breaker's case: records of up to 1 MiB (an analysis of 100 measurements is about 300 KB) and nothing
    # trimming history.jsonl: past its reader's 16 MiB every status, release and rollback said "damaged".
    import json

    from flatshare_ops.common.files import dumps
    from flatshare_ops.node import history

    path = tmp_path / "history.jsonl"
    lines = [dumps({"schema": 2, **_record("cyan", n)}, sort_keys=True) + "\n" for n in range(10_000)]
    path.write_text("".join(lines))
    assert path.stat().st_size > history.COMPACT_AT
    new = _record("cyan", 10_000)
    history.append(path, new, "cyan", compact_first=True)
    kept = path.read_text().splitlines(keepends=True)
    moved = (tmp_path / history.ARCHIVE).read_text().splitlines(keepends=True)
    # Every line once, in its order: the oldest in the archive, the newest (and the new record) in history.jsonl.
    assert moved + kept[:-1] == lines and json.loads(kept[-1])["switch"] == new["switch"]
    assert path.stat().st_size <= history.COMPACT_KEEP + len(kept[-1])
    read = history.read_history(path, "cyan")
    assert not read.skipped and read.disorder is None and read.records[-1]["after"] == "r10000"
    assert history.rollback_target(read, "r10000", lambda release: True) == "r9999"


def test_a_record_that_would_take_history_past_its_readers_bound_is_never_written(tmp_path):
    from flatshare_ops.common.files import dumps
    from flatshare_ops.node import history

    path = tmp_path / "history.jsonl"
    line = dumps({"schema": 2, **_record("cyan", 0, pad=1000)}, sort_keys=True) + "\n"
    path.write_text(line * (history.MAX_BYTES // len(line)))
    before = path.read_bytes()
    with pytest.raises(ValueError, match="past the .* its reader takes"):
        history.append(path, _record("cyan", 1), "cyan")  # not under the node's lock: never compacted here
    assert path.read_bytes() == before
    history.read_history(path, "cyan")  # still a file its reader takes


def test_a_history_record_from_before_schema_2_is_named_and_skipped_and_the_others_still_read(tmp_path):
    # Schema 1 (records without "schema", "result": "failed at STEP: why", "from"/"to") is no longer read: no node
    # keeps one, and a node that does is told how to start a new history.
    import json
    import time

    from flatshare_ops.node import history

    now = time.time()
    current = {"schema": 2, "node": "cyan", "switch": "s2", "kind": "release", "result": "released", "before": None,
               "after": "b" * 16, "target": "b" * 16, "served": True, "started_at": now, "finished_at": now + 1}
    path = tmp_path / "history.jsonl"
    path.write_text(json.dumps({"from": None, "to": "a" * 16, "result": "failed at restart-engine: boom"}) + "\n"
                    + json.dumps({"schema": 1, "from": None, "to": "a" * 16, "result": "released"}) + "\n"
                    + json.dumps(current) + "\n")
    read = history.read_history(path, "cyan")
    assert read.records == [current]
    assert read.skipped == [f"history.jsonl:{n}: a record of schema 1, written by a flatshare-ops before schema 2, "
                            "which this one does not read (no rollback returns to it; the file's other records are "
                            "read as ever: delete the line to end this note); skipped" for n in (1, 2)]


def test_a_write_that_fails_on_a_full_disk_names_its_file(tmp_path):
    # A breaker's case: a switch on a full run directory ended "drain-voice failed: ENOSPC (No space left on
    # device)", naming no file: write(2) and fsync(2) fail with no file name in Python's OSError.
    import errno
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    try:
        failures = []
        for write in (lambda p: durable.write_atomic(p, b"x" * (256 << 10)),
                      lambda p: durable.append_line(p, "y" * (256 << 10))):
            path = disk / "voice.drain"
            try:
                write(path)
            except OSError as err:
                failures.append((err.errno, err.filename))
        left = sorted(p.name for p in disk.iterdir() if p.stat().st_size)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert failures == [(errno.ENOSPC, str(disk / "voice.drain"))] * 2, failures
    assert left == [], left  # nothing of either stays
