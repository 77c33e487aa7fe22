"""Shared fixtures: the checkout copied to a scratch directory, the CLI, and a real systemd user manager."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# `flatshare` and `serving-check`, run by subprocess.run, start from this test process's zygote (tests/cli_zygote.py):
# the same process of their own, without importing everything again.
import cli_zygote  # noqa: E402

subprocess.run = cli_zygote.run


def pytest_configure(config):
    # FLATSHARE_TEST_CPU=FILE: each test's CPU, its processes' included, one JSON line each (tests/cpu_log.py)
    if os.environ.get("FLATSHARE_TEST_CPU"):
        import cpu_log

        config.pluginmanager.register(cpu_log.Recorder(os.environ["FLATSHARE_TEST_CPU"]), "flatshare-test-cpu")


def run_cli(*args: str, cwd: Path | None = None, program: str = "flatshare", env: dict | None = None,
            timeout: float = 300):
    """Run one of the project's console scripts; returns the CompletedProcess (text). ``timeout`` in seconds: a
    bound against a hang, never a speed the test asks for (a release of real engines takes minutes, and a
    command that imports vLLM took over 120 s with the suite, two sandboxes and make check on 2 CPUs)."""
    return subprocess.run(
        [str(BIN / program), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


FAULTS = Path(__file__).resolve().parent / "faults"


def faults(**spec) -> dict:
    """The environment that makes the node's side fail as ``spec`` says (tests/faults/sitecustomize.py)."""
    import json

    return {"PYTHONPATH": str(FAULTS), "FLATSHARE_TEST_FAULTS": json.dumps(spec)}


SIGNALS = Path(__file__).resolve().parent / "signals"


def signal_at(moments: str) -> dict:
    """The environment that makes a ``flatshare`` process send itself SIGTERM at ``moments``
    (tests/signals/sitecustomize.py); a fresh process reads it (``PYTHONPATH``), never a zygote's fork."""
    return {"PYTHONPATH": str(SIGNALS), "FLATSHARE_TEST_SIGNAL_AT": moments}


def copy_checkout(repo: Path, dest: Path) -> Path:
    """Copy what rendering and releasing read from a checkout (profiles, units, monitoring, the documents with
    generated parts) into ``dest``: a scratch checkout for tests and benchmarks to change freely. Returns ``dest``."""
    import shutil

    for name in ("profiles", "units", "monitoring"):
        shutil.copytree(repo / name, dest / name)
    for name in ("README.md", "PRODUCTION.md", "docs/reference/commands.md"):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, dest / name)
    return dest


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the checkout's profile, rendered files and documents, to change freely."""
    return copy_checkout(REPO, tmp_path / "checkout")


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes: to prove nothing was written."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def user_manager(tmp_path_factory):
    """A real ``systemd --user`` manager of its own for the test session; yields its ManagerDirs."""
    from flatshare_ops.sandbox.manager import ManagerDirs, start_manager, stop_manager

    base = tmp_path_factory.mktemp("manager")
    name = f"test-{uuid.uuid4().hex[:8]}"
    dirs = ManagerDirs(name=name, runtime_dir=base / "run", config_dir=base / "config", log=base / "manager.log")
    pid = start_manager(dirs)
    yield dirs
    stop_manager(name, pid)


# --- parallel test processes (pytest-xdist) ------------------------------------------------------------
#
# `make test` runs the tests in parallel processes: `pytest -n N --dist loadgroup --no-loadscope-reorder`.
# xdist sends each group of tests (the xdist_group mark) to one process, whole; a test without a mark is
# put in its module's group, so a module's fixtures (its sandbox fleet) are set up in one process only.
# A long module is split by marking some of its tests with a group of their own (a name starting with
# the module's): each group then brings up its own fleet, in whichever process runs it. Mark tests or a
# module's pytestmark, never both (xdist joins every group name it finds).
#
# The groups are sent longest first (GROUP_SECONDS: the sum of each group's test durations in a full `make test`
# on this machine's 2 CPUs, four processes; a group not listed counts as short), so that no process is left with a
# long group at the end. The real engines' tier and the machines tier (each about a quarter of the whole) go first,
# a process each; the other processes share the rest.

GROUP_SECONDS = {
    "test_real_engine": 1010, "test_machines": 900, "test_fleet_safety": 590, "test_canary": 370,
    "test_node_state_damaged_logs": 330, "test_node_state": 320, "test_node_damage": 320,
    "test_fleet_safety_sessions": 290, "test_node_state_rollbacks": 250, "test_fleet_safety_signals": 220,
    "test_release": 200, "test_node_state_writes": 180, "test_fleet_safety_race": 160,
    "test_production_path_runbook": 90, "test_rollout_strategy": 90, "test_release_changes": 90,
    "test_release_crashes": 80, "session_sandbox": 70, "test_production_path": 70, "test_lock": 70, "vllm_parser": 60,
    "test_make_profiles": 50, "test_node_system": 40, "test_variants": 30, "test_traffic": 30, "test_hostile_values": 30,
}
#: Modules that share what a test process keeps for its session, in one group: the session's `sandbox`
#: fleet (below), and vLLM's parsers (vllm_parse_many).
MODULE_GROUPS = {
    "test_sandbox": "session_sandbox", "test_serving_check": "session_sandbox",
    "test_vllm_parser": "vllm_parser", "test_vllm_argv_differential": "vllm_parser",
}


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default")) if mark else ""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not _group(item):
            item.add_marker(pytest.mark.xdist_group(MODULE_GROUPS.get(item.path.stem, item.path.stem)))
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike (a stable sort of a table)
        items.sort(key=lambda item: -GROUP_SECONDS.get(_group(item), 0))


# --- vLLM's parser, one process per release and test process -------------------------------------------

VLLM_PARSER = Path(__file__).resolve().parent / "vllm_parser" / "serve_lines.py"
_vllm_parsers: dict = {}  # interpreter -> (its running tests/vllm_parser/serve_lines.py, that one's stderr)


def vllm_parse_many(python: Path, argvs: list[list[str]], timeout_s: float = 600) -> list[dict]:
    """vLLM's result for each argv (the words after `vllm serve`), as vllm_serve_parse.py's parse-many gives
    them, from a parser that ``python`` (a parser venv's interpreter) runs once for this test process
    (tests/vllm_parser/serve_lines.py) and keeps for every later call."""
    import atexit
    import json
    import threading

    import tempfile

    process, errors = _vllm_parsers.get(python, (None, None))
    if process is None or process.poll() is not None:
        errors = tempfile.TemporaryFile("w+")
        process = subprocess.Popen([str(python), str(VLLM_PARSER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=errors, text=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
        _vllm_parsers[python] = (process, errors)
        atexit.register(process.kill)
    watchdog = threading.Timer(timeout_s, process.kill)  # no answer within the bound fails the test
    watchdog.start()
    try:
        process.stdin.write(json.dumps(argvs) + "\n")
        process.stdin.flush()
        answer = process.stdout.readline()
    finally:
        watchdog.cancel()
    if not answer:
        errors.seek(0)
        raise AssertionError(f"{python} {VLLM_PARSER} ended without an answer (exit {process.wait()}):\n"
                             + errors.read()[-3000:])
    results = json.loads(answer)
    assert len(results) == len(argvs), (len(results), len(argvs))
    return results


# --- loopback addresses ---------------------------------------------------------------------------------
#
# Every sandbox a test brings up listens on addresses of its own: cyan 127.BLOCK.LANE.2, peacock
# 127.BLOCK.LANE.3 (and .4 for a stand-in started by hand), from loopback_pair(BLOCK).
#
# - BLOCK is the module's own (or a fixture's), registered in BLOCKS: no two modules share one, so that
#   modules running at once in different test processes (xdist's workers) never share an address
#   (tests/test_layout.py checks that each module asks only for the blocks registered to it).
# - LANE is the test process's own (1 to 250): the first lane whose lock file
#   (/tmp/flatshare-test-lanes/LANE.lock) no other process holds and on which nothing listens, held until
#   the process ends. So two workers of one run, or two runs from two checkouts, never share a lane.
#   Lane 0 is left to sandboxes made by hand (make demo's cyan is 127.0.0.2).

#: Block -> the test module that brings up sandboxes on it (conftest: the session's `sandbox` fixture).
BLOCKS = {
    0: "conftest", 1: "test_sandbox", 2: "test_sandbox", 3: "test_release", 11: "test_release_changes",
    13: "test_variants", 17: "test_production_path", 19: "test_production_path", 21: "test_production_path",
    51: "test_node_state", 59: "test_node_state", 61: "test_fleet_safety", 71: "test_real_engine", 73: "test_traffic",
    76: "test_monitoring", 79: "test_lock", 80: "test_leftovers", 81: "test_node_damage", 82: "test_canary",
    83: "test_rollout_strategy", 84: "test_machines",
}
LANES = Path("/tmp/flatshare-test-lanes")
_lane: list = []  # [lane number, its open lock file], once taken


def _listening_lanes() -> set[int]:
    """Third octets of the 127.x.y.z addresses (x > 0) something listens on (TCP), from /proc/net/tcp."""
    lanes: set[int] = set()
    try:
        rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return lanes
    for row in rows:
        fields = row.split()
        if len(fields) > 3 and fields[3] == "0A":  # LISTEN
            octets = bytes.fromhex(fields[1].split(":")[0])[::-1]  # little-endian in the kernel's table
            if octets[0] == 127 and octets[1] > 0:
                lanes.add(octets[2])
    return lanes


def process_lane() -> int:
    """This test process's lane (1 to 250), taken on first use and held until the process ends."""
    import fcntl

    if not _lane:
        LANES.mkdir(parents=True, exist_ok=True)
        busy = _listening_lanes()
        for lane in range(1, 251):
            if lane in busy:
                continue
            f = open(LANES / f"{lane}.lock", "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            f.truncate(0)
            f.write(f"{os.getpid()}\n")
            f.flush()
            _lane[:] = [lane, f]
            break
        else:
            raise RuntimeError(f"no free test lane in {LANES} (250 test processes at once?)")
    return _lane[0]


def loopback_nodes(block: int, names: tuple[str, ...]) -> dict[str, str]:
    """Loopback addresses for a sandbox of block ``block`` (a module's own; see above) in this test process:
    the i-th name gets 127.BLOCK.LANE.(i + 2), at most 250 names."""
    if block not in BLOCKS:
        raise ValueError(f"loopback block {block} is not registered in tests/conftest.py's BLOCKS")
    lane = process_lane()
    return {name: f"127.{block}.{lane}.{i + 2}" for i, name in enumerate(names)}


def loopback_pair(block: int) -> dict[str, str]:
    """Loopback addresses for a cyan and peacock sandbox of block ``block`` in this test process."""
    return loopback_nodes(block, ("cyan", "peacock"))


TEST_ADDRESSES = loopback_pair(0)


def without_canaries(base: Path) -> None:
    """Give the sandbox inventory ``base/fleet.toml`` (an ``up``'s; ``up`` keeps it) ``[rollout] canaries = 0``:
    a rollout switches node by node with no canary analysis, for tests of something else on a fleet with
    no calls to measure (the profile's analysis, with none, would wait its two minutes and pause: exit 11;
    the analysis's own tests: test_canary, test_rollout_strategy, test_real_engine)."""
    import tomlkit

    path = base / "fleet.toml"
    doc = tomlkit.parse(path.read_text())
    doc.setdefault("rollout", tomlkit.table())["canaries"] = 0
    path.write_text(tomlkit.dumps(doc))


@contextmanager
def calls_to(addresses: dict[str, str], callers: list[tuple], tokens: int, timeout_s: float,
             join_s: float, pause_s: float = 0.0):
    """Calls streaming through the nodes' gateways while the block runs; yields the list the callers' reports
    (``sandbox/caller.py``) are added to.

    Args:
        addresses: node name -> loopback address (the gateways listen on port 8080).
        callers: each caller's gateways in the order it dials them (node names), how many calls it keeps going at
            once and, optionally, its seats' own pause between calls (seconds; else ``pause_s``) and the tokens its
            calls ask for (else ``tokens``).
        tokens: tokens each call asks for.
        timeout_s: a call's own bound, in seconds.
        join_s: how long, in seconds, each caller may take to stop after the block.
        pause_s: each seat's pause between its calls (seconds; ``run_calls``): 0 keeps both CPUs busy.
    """
    import threading

    from flatshare_ops.sandbox.caller import Gateway, run_calls

    stop, reports = threading.Event(), []
    def own(caller: tuple, index: int, default):
        return caller[index] if len(caller) > index and caller[index] is not None else default

    threads = [threading.Thread(target=lambda order=caller[0], concurrency=caller[1], pause=own(caller, 2, pause_s),
                                asked=own(caller, 3, tokens): reports.extend(run_calls(
            [Gateway(n, f"http://{addresses[n]}:8080") for n in order], concurrency=concurrency, duration_s=900,
            tokens=asked, timeout_s=timeout_s, stop=stop, pause_s=pause)), daemon=True)
        for caller in callers]
    for thread in threads:
        thread.start()
    try:
        yield reports
    finally:
        stop.set()
        for thread in threads:
            thread.join(join_s)


def calls_through_both(addresses: dict[str, str], concurrency: int, tokens: int, timeout_s: float, join_s: float,
                       pause_s: float = 0.0):
    """:func:`calls_to` with two callers, each dialling both cyan and peacock (one cyan first, one peacock
    first), ``concurrency`` calls each: a canary and its baseline both serve calls, and either takes them all
    while the other is drained."""
    return calls_to(addresses, [(("cyan", "peacock"), concurrency), (("peacock", "cyan"), concurrency)], tokens,
                    timeout_s, join_s, pause_s)


def quick_stand_in(profile: Path) -> None:
    """Sandbox-only speed in a node's profile: the stand-in engine loads in 0.2 s (not 1 s), and a voice drain
    that cannot be confirmed is given up on after 3 s (not 20 s; the stand-in drains at once with no calls)."""
    text = profile.read_text()
    assert 'FLATSHARE_STANDIN_LOAD_S = "1"' in text and "drain_timeout_s = 20" in text
    profile.write_text(text.replace('FLATSHARE_STANDIN_LOAD_S = "1"', 'FLATSHARE_STANDIN_LOAD_S = "0.2"')
                       .replace("drain_timeout_s = 20", "drain_timeout_s = 3"))


@contextmanager
def scratch_sandbox(tmp_path_factory, label: str, addresses: dict[str, str], canaries: bool = False,
                    prepare=None, **up_options):
    """A scratch copy of the checkout (``copy_checkout``) and a sandbox fleet brought up from it on ``addresses``,
    for a module's tests to change freely; yields ``(scratch, checkout, base)``: the scratch directory
    (``tmp_path_factory.mktemp(label)``: keep ``label`` short, a node's sockets live below it), the checkout and
    the sandbox directory. The fleet is brought down afterwards, also when ``up`` failed half-way.

    Args:
        canaries: keep the inventory's canary analysis (the analysis's own tests); otherwise ``without_canaries``.
        prepare: called with the checkout before ``up`` (to change what the fleet is brought up from).
        up_options: passed to ``up`` (``engine="vllm"``, ``system_scope``...).
    """
    from flatshare_ops.sandbox.fleet import down, up

    scratch = tmp_path_factory.mktemp(label)
    checkout = copy_checkout(REPO, scratch / "checkout")
    if prepare is not None:
        prepare(checkout)
    base = scratch / "sandbox"
    try:
        up(base, checkout / "profiles/rtx-5060-ti-serve.toml", addresses, echo=lambda _l: None, **up_options)
        if not canaries:
            without_canaries(base)
        yield scratch, checkout, base
    finally:
        down(base, echo=lambda _l: None)


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory):
    """The sandbox fleet, up once for the test session on its own loopback addresses; down at the end.

    Yields the sandbox directory; its inventory is ``DIR/fleet.toml``.
    """
    from flatshare_ops.sandbox.fleet import down, up

    base = tmp_path_factory.mktemp("sandbox")
    try:
        up(base, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=lambda _line: None)
        without_canaries(base)
        yield base
    finally:
        down(base, echo=lambda _line: None)


def installed_files(venv: Path) -> list[str]:
    """The files pip installed into the venv ``venv`` for flatshare-ops, as pip's RECORD of the install lists them
    (paths relative to its site-packages, e.g. ``flatshare_ops/node/entry.py``)."""
    (record,) = (venv / "lib").glob("python3*/site-packages/flatshare_ops-*.dist-info/RECORD")
    return [line.split(",", 1)[0] for line in record.read_text().splitlines()]
