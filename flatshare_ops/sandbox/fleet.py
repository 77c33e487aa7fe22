"""``flatshare sandbox up | status | down``: the local two-node fleet.

Each node gets, under ``BASE/NODE/``:

- ``etc/systemd/user/``: its unit directory (the manager's ``XDG_CONFIG_HOME`` is ``etc``);
- ``var/lib/flatshare/``: state (releases, the serve module), ``run/flatshare/``: drain files;
- ``run/user/``: its systemd user manager's ``XDG_RUNTIME_DIR``;
- ``opt/engine-venv/``: an engine venv with the stand-in ``bin/vllm``, vLLM's metadata and the
  stand-in ``vllm`` package (sandbox/vllm_standin) the preflight parses with; a variant on
  another vLLM release gets ``opt/engine-venv-RELEASE/`` beside it. With ``--engine vllm`` the
  node's profile points at the checkout's ``.venv-vllm`` instead (vLLM 0.32.0's real engine, shared
  by the nodes) and at a tiny model made at ``up`` (``var/lib/flatshare/models/tiny-llama``);
- ``var/log/flatshare/``: each service's output (``UNIT.log``: the manager has no journald);
- ``ssh/``: its OpenSSH server's host key, config and log;
- ``profile.toml``: the production profile, extended with this node's layout, and
  ``profile-VARIANT.toml`` for each variant profile beside production.

``BASE/ssh/`` holds the operator's client key, ``authorized_keys`` and
``known_hosts``; ``BASE/fleet.toml`` is the sandbox inventory and
``BASE/state.json`` the process ids ``down`` stops.

A node that is not ``--bare`` is brought up as a bootstrapped node would be (its layout, the
serve module built once, its host key known, flatshare-ops this checkout's): with no release.
Its first release is the real one (``flatshare release``), which installs and starts the units
and writes the node's history: ``up`` runs it (:func:`first_release`) unless told not to, as
``flatshare sandbox up`` is, so that ``make demo``'s release is that first switch.
"""

from __future__ import annotations

import json
import os
import shutil
import re
import signal
import subprocess
import sys
import time
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from filelock import FileLock, Timeout
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..common import systemd
from ..common import durable
from ..common.http import http_get
from ..common.poll import poll_until
from ..common.proc import pid_alive, read_cmdline
from ..common.units import ENGINE_UNIT, SERVICE_UNITS, TARGET_UNIT
from ..config.profile import load_profile
from ..node.store import current_release
from ..render.units import engine_url
from ..errors import FlatshareError
from ..schema_errors import one_line
from ..common.systemd import ManagerAddress
from .manager import ManagerDirs, SandboxError, refuse_long_socket_paths, start_manager, stop_manager
from . import node_profile
from ..common.text import clip_tail

DEFAULT_ADDRESSES = {"cyan": "127.0.0.2", "peacock": "127.0.0.3"}
SSH_PORT = 2222
ENGINE_PORT = 8000  # the production profile's engine port, kept in the sandbox
GATEWAY_PORT = node_profile.GATEWAY_PORT
VOICE_PORT = node_profile.VOICE_PORT
SSHD = "/usr/sbin/sshd"
#: The PATH of a sandbox node's SSH sessions: this Python's own bin directory (the node's python3 is the
#: operator's, as bootstrap requires), then sshd's default (OpenSSH's _PATH_STDPATH). Each node's sessions
#: also get a HOME of their own (DIR/NODE/home, through sshd_config's SetEnv, which OpenSSH applies after
#: its own HOME and PATH): bash reads ~/.bashrc when sshd runs it (bash(1), INVOCATION), and the
#: operator's (on this machine kind, pyenv's init: 0.1 s for every command) is not the node's.
NODE_PATH = f"{Path(sys.base_prefix) / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class SandboxNode:
    """One sandbox node's name, loopback address and directories.

    Attributes:
        scope: ``user`` (the tool reaches the manager on its private socket) or ``system`` (the node
            gets a bus of its own, where its manager owns org.freedesktop.systemd1, and the tool uses
            the system-scope path through ``DBUS_SYSTEM_BUS_ADDRESS``).
        bare: a fresh node: only sshd, its manager and an engine venv; flatshare-ops is not installed
            (``flatshare node bootstrap`` does it), no release, and its host key is not in known_hosts.
    """

    name: str
    address: str
    base: Path
    scope: Literal["user", "system"] = "user"
    bare: bool = False
    engine: Literal["vllm", "stand-in"] = "stand-in"

    @property
    def bus(self) -> Path:
        """A system-scope node's bus socket (its manager's ``$XDG_RUNTIME_DIR/bus``)."""
        return self.manager.runtime_dir / "bus"

    @property
    def ops_dir(self) -> Path:
        """Where the node's flatshare-ops is installed: this checkout's venv, or (bare) the node's own."""
        return self.root / "opt/flatshare-ops" if self.bare else Path(sys.executable).parent.parent.parent

    @property
    def root(self) -> Path:
        """The node's root directory."""
        return self.base / self.name

    @property
    def manager(self) -> ManagerDirs:
        """The node's systemd user manager directories."""
        return ManagerDirs(
            # Unique per sandbox directory, so two checkouts' sandboxes never share a cgroup.
            name=f"{self.name}-{_sha256(str(self.base).encode())[:8]}",
            runtime_dir=self.root / "run/user",
            config_dir=self.root / "etc",
            log=self.root / "manager.log",
        )

    @property
    def venv(self) -> Path:
        """The node's engine venv."""
        return self.root / "opt/engine-venv"

    @property
    def state_dir(self) -> Path:
        """What production keeps in /var/lib/flatshare."""
        return self.root / "var/lib/flatshare"

    @property
    def run_dir(self) -> Path:
        """What production keeps in /run/flatshare: the units' RuntimeDirectory, under the manager's runtime dir."""
        return self.manager.runtime_dir / "flatshare"

    @property
    def output_dir(self) -> Path:
        """Where the node's services append their output (``UNIT.log``; the profile's layout.output)."""
        return self.root / "var/log/flatshare"

    @property
    def model(self) -> Path:
        """The model the node's engine serves: the tiny Llama (real engine) or the stand-in's directory."""
        name = node_profile.TINY_MODEL if self.engine == "vllm" else "flatshare-chat"
        return self.state_dir / "models" / name

    @property
    def ssh_dir(self) -> Path:
        """The node's sshd files."""
        return self.root / "ssh"

    @property
    def profile(self) -> Path:
        """The node's profile (extends the production one)."""
        return self.root / "profile.toml"

    def variant_profile(self, variant: Path) -> Path:
        """The node's profile for a variant (extends the checkout's variant): ``profile-VARIANT.toml``."""
        return self.root / f"profile-{variant.stem}.toml"


def parse_addresses(text: str | None) -> dict[str, str] | None:
    """``cyan=127.0.0.2,peacock=127.0.0.3`` -> {name: address}; None keeps the defaults.

    Raises:
        SandboxError: not NAME=ADDRESS pairs, or an address outside 127.0.0.0/8.
    """
    if not text:
        return None
    import ipaddress

    result = {}
    for pair in text.split(","):
        name, _, address = pair.strip().partition("=")
        try:
            loopback = ipaddress.IPv4Address(address).is_loopback
        except ValueError:
            loopback = False
        if not re.fullmatch(r"[a-z][a-z0-9-]*", name) or not loopback:
            raise SandboxError(f"--addresses: {pair!r} is not NAME=127.x.y.z (a loopback address)", exit_code=2)
        result[name] = address
    return result


def nodes(base: Path, addresses: dict[str, str] | None = None, system_scope: tuple[str, ...] = (),
          bare: tuple[str, ...] = (), engine: Literal["vllm", "stand-in"] = "stand-in") -> list[SandboxNode]:
    """The sandbox's nodes, in inventory order (``system_scope`` and ``bare`` name nodes set up so)."""
    return [SandboxNode(name, address, base, "system" if name in system_scope else "user", name in bare, engine)
            for name, address in (addresses or DEFAULT_ADDRESSES).items()]


# --- files -----------------------------------------------------------------


#: Beside each node's profiles: the sha256 of each profile as ``up`` last wrote it, so that one changed by hand
#: since is kept, not overwritten (as dpkg keeps a changed conffile).
WRITTEN_PROFILES = ".profiles-written.json"


def write_node_profile(node: SandboxNode, production: Path, vllm_release: str, venv_dir: Path | None = None,
                       path: Path | None = None, engine: str | None = None) -> bool:
    """Write the node's profile: ``production``'s (or a variant's), with the sandbox layout and its engine
    (:mod:`.node_profile`), in TOML written by tomlkit; a profile changed since ``up`` wrote it (its sha256 is
    no longer the one recorded in :data:`WRITTEN_PROFILES`) is kept as it is.

    Args:
        production: the profile it extends.
        venv_dir: the engine venv (default: the real engine's shared venv, or the node's stand-in venv).
        path: where to write it (default the node's ``profile.toml``).
        engine: ``vllm`` or ``stand-in`` (default the node's).

    Returns:
        True when a profile changed by hand was kept (the caller says so), else False.

    Raises:
        ProfileError: the profile (written or kept) does not validate.
    """
    engine = engine or node.engine
    module_dir = node.state_dir / "module"
    layout = {"scope": node.scope, "unit_dir": str(node.manager.unit_dir), "state_dir": str(node.state_dir),
              "run_dir": str(node.run_dir)}
    if node.scope == "system":
        # A user manager runs the services (it cannot switch to another user): User=root, its own.
        layout["service_user"] = "root"
    default_venv = node_profile.engine_venv() if engine == "vllm" else node.venv
    model = node.model if engine == node.engine else node.state_dir / "models/flatshare-chat"
    text = node_profile.node_document(
        extends=production, engine=engine, venv=venv_dir or default_venv, model=model, address=node.address,
        state_dir=node.state_dir, module_dir=module_dir,
        check_command=[str(node.ops_dir / ".venv/bin/serving-check"), "--quiet"], layout=layout,
        output_dir=node.output_dir)
    return write_profile_unless_edited(path or node.profile, text)


def write_profile_unless_edited(target: Path, text: str) -> bool:
    """Write a node profile ``up`` made, unless it was changed by hand since ``up`` last wrote it (its sha256 is
    no longer the one recorded in :data:`WRITTEN_PROFILES` beside it): that one is kept, as dpkg keeps a changed
    conffile.

    Returns:
        True when a profile changed by hand was kept (the caller says so), else False.

    Raises:
        SandboxError: the note beside it is damaged. ProfileError: the profile (written or kept) does not validate.
    """
    record = target.parent / WRITTEN_PROFILES
    written = _written_profiles(record)
    current = target.read_bytes() if target.is_file() and not target.is_symlink() else None
    edited = current is not None and current != text.encode() and written.get(target.name) not in (
        None, _sha256(current))
    if not edited:
        _write_if_changed(target, text.encode())
        if written.get(target.name) != _sha256(text.encode()):
            _write_if_changed(record, (json.dumps({**written, target.name: _sha256(text.encode())}, indent=2,
                                                  sort_keys=True) + "\n").encode())
    load_profile(target)  # refuse to go on with a profile that does not validate
    return edited


def _written_profiles(record: Path) -> dict[str, str]:
    """The note of what ``up`` last wrote (:data:`WRITTEN_PROFILES`): profile file name -> sha256.

    Raises:
        SandboxError (exit 2): the note is damaged (not a regular file, too large, not a JSON object of
            names and digests): one line, and the way out; nothing is written over a profile then.
    """
    from ..common.files import Damaged, read_json_object

    try:
        note: dict | Damaged = read_json_object(record, limit=1 << 16) or {}
    except Damaged as err:
        note = err
    if isinstance(note, Damaged) or not all(isinstance(k, str) and isinstance(v, str) for k, v in note.items()):
        why = note.form if isinstance(note, Damaged) else "not a JSON object of profile names and sha256 digests"
        raise SandboxError(f"{record}: {why}; move it aside (sandbox up then writes every profile beside it "
                           "afresh, changed by hand or not)", exit_code=2)
    return note


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _write_if_changed(path: Path, data: bytes, mode: int = 0o644) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.read_bytes() == data:
        return False
    durable.write_atomic(path, data, mode)
    return True


def variant_profiles(production: Path) -> list[Path]:
    """The checkout's variant profiles beside production (every other ``*.toml`` but the inventory)."""
    return sorted(p for p in production.parent.glob("*.toml") if p.name not in (production.name, "fleet.toml"))


def make_engine_venv(node: SandboxNode, vllm_release: str, venv_dir: Path | None = None) -> None:
    """Create an engine venv (default the node's): a real venv, the stand-in ``bin/vllm``, vLLM's metadata
    for ``vllm_release`` and the stand-in ``vllm`` package laid out as that release lays it out."""
    venv_dir = venv_dir or node.venv
    if not (venv_dir / "bin/python").exists():
        venv.EnvBuilder(with_pip=False, symlinks=True).create(venv_dir)
    vllm = f"#!{sys.executable}\n# Stand-in for vLLM's console script (flatshare-ops sandbox).\n" \
        "from flatshare_ops.sandbox.engine import main\nmain()\n"
    _write_if_changed(venv_dir / "bin/vllm", vllm.encode(), mode=0o755)
    site = next(venv_dir.glob("lib/python*/site-packages"))
    for stale in site.glob("vllm-*.dist-info"):
        if stale.name != f"vllm-{vllm_release}.dist-info":
            for f in stale.iterdir():
                f.unlink()
            stale.rmdir()
    metadata = f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm_release}\nSummary: flatshare-ops sandbox stand-in\n"
    _write_if_changed(site / f"vllm-{vllm_release}.dist-info/METADATA", metadata.encode())
    install_vllm_standin(site, vllm_release)


def install_vllm_standin(site: Path, vllm_release: str) -> None:
    """Put the stand-in ``vllm`` package (sandbox/vllm_standin) into an engine venv's site-packages,
    laid out as ``vllm_release`` lays out its modules, and make flatshare-ops importable there (a .pth
    file naming this checkout), so that the node's preflight runs the same script as in production."""
    source = Path(__file__).parent / "vllm_standin"
    moved = tuple(int(p) for p in vllm_release.split(".")[:2]) >= (0, 33)
    for path in sorted(source.rglob("*.py")):
        relative = path.relative_to(source)
        if relative.parts[:2] == ("entrypoints", "common") and not moved:
            continue  # 0.32.0 has no vllm.entrypoints.common; the preflight script tells the releases apart by it
        _write_if_changed(site / "vllm" / relative, path.read_bytes())
    _write_if_changed(site / "flatshare_ops_checkout.pth", f"{Path(__file__).resolve().parents[2]}\n".encode())


def _keygen(path: Path, comment: str) -> None:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)


def write_ssh_files(base: Path, sandbox_nodes: list[SandboxNode]) -> set[str]:
    """Generate host keys and the client key; write authorized_keys, known_hosts and each sshd_config.

    Returns the names of the nodes whose sshd_config changed (a running sshd reads it only at start).
    """
    changed: set[str] = set()
    client_key = base / "ssh/id_ed25519"
    _keygen(client_key, "flatshare-sandbox-operator")
    _write_if_changed(base / "ssh/authorized_keys", client_key.with_suffix(".pub").read_bytes(), 0o600)
    bare_labels = {f"[{n.address}]:{SSH_PORT}" for n in sandbox_nodes if n.bare}
    try:  # a bare node's key is added by 'flatshare node bootstrap --accept-host-key': keep it
        kept = [row + "\n" for row in (base / "ssh/known_hosts").read_text().splitlines()
                if row.split(" ")[0] in bare_labels]
    except FileNotFoundError:
        kept = []
    known = list(kept)
    for node in sandbox_nodes:
        host_key = node.ssh_dir / "ssh_host_ed25519_key"
        _keygen(host_key, f"{node.name}-host")
        kind, blob = host_key.with_suffix(".pub").read_text().split()[:2]
        if not node.bare:
            known.append(f"[{node.address}]:{SSH_PORT} {kind} {blob}\n")
        system_bus = f" DBUS_SYSTEM_BUS_ADDRESS=unix:path={node.bus}" if node.scope == "system" else ""
        home = node.root / "home"
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        config = f"""# sshd for sandbox node {node.name} (written by flatshare sandbox up)
ListenAddress {node.address}:{SSH_PORT}
HostKey {host_key}
PidFile {node.ssh_dir / "sshd.pid"}
AuthorizedKeysFile {base / "ssh/authorized_keys"}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
SetEnv HOME={home} PATH={NODE_PATH} FLATSHARE_NODE={node.name} FLATSHARE_INVENTORY={base / "fleet.toml"}{system_bus}
Subsystem sftp internal-sftp
"""
        if _write_if_changed(node.ssh_dir / "sshd_config", config.encode()):
            changed.add(node.name)
    _write_if_changed(base / "ssh/known_hosts", "".join(known).encode())
    return changed


def write_inventory(base: Path, sandbox_nodes: list[SandboxNode]) -> Path:
    """Write ``BASE/fleet.toml``, the sandbox's inventory (tomlkit); returns its path.

    Its ``nodes`` table is ``up``'s; whatever else an operator added to an inventory ``up`` wrote before
    (``[rollout]``, ``[transport]``, ``min_serving``) is kept. One that no longer parses as TOML is
    written anew.
    """
    import tomlkit
    from tomlkit.exceptions import ParseError

    path = base / "fleet.toml"
    doc = None
    if path.is_file():
        try:
            doc = tomlkit.parse(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ParseError):
            doc = None
    if doc is None:
        doc = tomlkit.document()
        doc.add(tomlkit.comment("The sandbox inventory, written by `flatshare sandbox up`."))
    doc["schema"] = 1
    table = tomlkit.table(is_super_table=True)
    for node in sandbox_nodes:
        entry = tomlkit.table()
        entry["host"] = node.address
        entry["port"] = SSH_PORT
        entry["user"] = "root"
        entry["profile"] = str(node.profile.relative_to(base))
        entry["known_hosts"] = "ssh/known_hosts"
        entry["identity"] = "ssh/id_ed25519"
        entry["scope"] = node.scope
        if node.scope == "user":
            entry["runtime_dir"] = str(node.manager.runtime_dir.relative_to(base))
        table[node.name] = entry
    doc["nodes"] = table
    _write_if_changed(path, tomlkit.dumps(doc).encode())
    return path


# --- processes -------------------------------------------------------------


class NodeRecord(BaseModel):
    """The process ids ``up`` started on one node (``state.json``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    manager_pid: int | None = Field(default=None, gt=1)
    sshd_pid: int | None = Field(default=None, gt=1)
    scope: Literal["user", "system"] = "user"
    bare: bool = False
    engine: Literal["vllm", "stand-in"] = "stand-in"


class SandboxState(BaseModel):
    """``BASE/state.json``: what ``down`` may stop."""

    model_config = ConfigDict(extra="forbid", strict=True)
    schema_: Literal[1] = Field(default=1, alias="schema")
    nodes: dict[str, NodeRecord] = Field(default_factory=dict)


def _read_state(base: Path) -> SandboxState:
    path = base / "state.json"
    if base.exists() and not base.is_dir():
        raise SandboxError(f"{base}: not a directory; give the sandbox directory with --dir", exit_code=2)
    from ..common.files import Damaged, read_json_object

    try:  # bounded, never blocking on what is there, RFC 8259's numbers
        document = read_json_object(path)
        return SandboxState() if document is None else SandboxState.model_validate(document)
    except (Damaged, ValidationError) as err:
        reason = one_line(err) if isinstance(err, ValidationError) else err.form
        raise SandboxError(
            f"{path}: unreadable sandbox state ({reason}); stop its processes by hand "
            "(ps aux | grep -e 'systemd --user' -e sshd) and remove the file", exit_code=2,
        ) from None


def _write_state(base: Path, state: SandboxState) -> None:
    text = state.model_dump_json(by_alias=True, indent=2) + "\n"
    durable.write_atomic(base / "state.json", text.encode())


def _cmdline(pid: int) -> str:
    try:
        return " ".join(read_cmdline(pid))
    except OSError:
        return ""


def _owns_manager(node: SandboxNode, pid: int | None) -> bool:
    """``pid`` is this node's systemd user manager: alive, systemd, in the node's own cgroup."""
    if not pid or not pid_alive(pid) or "systemd --user" not in _cmdline(pid):
        return False
    try:
        groups = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    return f"/flatshare-{node.manager.name}" in groups


def _owns_sshd(node: SandboxNode, pid: int | None) -> bool:
    """``pid`` is this node's sshd: alive and started with the node's own sshd_config."""
    return bool(pid and pid_alive(pid) and str(node.ssh_dir / "sshd_config") in _cmdline(pid))


def _manager_answers(node: SandboxNode) -> bool:
    try:
        systemd.properties(ManagerAddress("user", node.manager.runtime_dir), [])
        return True
    except systemd.SystemdError:
        return False


def _listening(address: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((address, port), timeout=0.2).close()
        return True
    except OSError:
        return False


def _refuse_taken_ports(node: SandboxNode) -> None:
    """Before starting a node from scratch: nothing else may listen on its address's ports."""
    for port in (SSH_PORT, ENGINE_PORT, GATEWAY_PORT, VOICE_PORT):
        if _listening(node.address, port):
            raise SandboxError(
                f"{node.name}: {node.address}:{port} is already in use; run 'flatshare sandbox down' "
                "for the sandbox that holds it (or stop that process)"
            )


def _start_sshd(node: SandboxNode) -> int:
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    log = open(node.ssh_dir / "sshd.log", "ab")
    process = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(node.ssh_dir / "sshd_config")],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
    )
    log.close()
    if poll_until(lambda: process.poll() is not None or _listening(node.address, SSH_PORT), 10.0):
        if process.poll() is None:
            return process.pid
        raise SandboxError(f"{node.name}: sshd exited with {process.returncode}; see {node.ssh_dir / 'sshd.log'}")
    process.kill()
    raise SandboxError(f"{node.name}: sshd did not listen on {node.address}:{SSH_PORT} within 10 s")


def _sandbox_lock(base: Path) -> FileLock:
    """One ``up`` or ``down`` at a time per sandbox directory.

    Raises:
        SandboxError: ``base`` is not a directory (exit 2), its lock file cannot be made, or another
            ``up``/``down`` holds it.
    """
    if not base.is_dir():
        raise SandboxError(f"{base}: not a sandbox directory (none was brought up there); give it with --dir",
                           exit_code=2)
    lock = FileLock(str(base / ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:  # filelock says Timeout also when it cannot make the file at all
            os.close(os.open(base / ".lock", os.O_WRONLY | os.O_CREAT, 0o644))
        except OSError as err:
            raise SandboxError(f"{base}: cannot make its lock file ({err.strerror or err})", exit_code=2) from None
        raise SandboxError(f"{base}: another 'flatshare sandbox up/down' is running on this sandbox; wait for it") from None
    return lock


def _manager_env(node: SandboxNode) -> dict[str, str]:
    """What a node's manager passes on to its services (a system-scope node's bus, for serving-check)."""
    return {"DBUS_SYSTEM_BUS_ADDRESS": f"unix:path={node.bus}"} if node.scope == "system" else {}


def write_system_bus(node: SandboxNode) -> None:
    """Give a system-scope node a bus of its own: a dbus-daemon its manager starts by socket activation
    (``dbus.socket`` at ``$XDG_RUNTIME_DIR/bus``), on which the manager then owns org.freedesktop.systemd1,
    as the system manager does on the system bus. The tool reaches it through ``DBUS_SYSTEM_BUS_ADDRESS``.
    (A user manager connects its API to a bus only while its own dbus.socket and dbus.service run.)"""
    config = node.root / "dbus/system-bus.conf"
    _write_if_changed(config, b"""<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<!-- The sandbox node's own bus (flatshare sandbox up): root only, everything allowed. -->
<busconfig>
  <listen>systemd:</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
""")
    unit_dir = node.manager.unit_dir
    _write_if_changed(unit_dir / "dbus.socket", b"[Unit]\nDescription=The sandbox node's system bus socket\n\n"
                      b"[Socket]\nListenStream=%t/bus\n")
    _write_if_changed(unit_dir / "dbus.service", (
        "[Unit]\nDescription=The sandbox node's system bus\nRequires=dbus.socket\n\n[Service]\n"
        f"ExecStart=/usr/bin/dbus-daemon --config-file={config} --address=systemd: --nofork --nopidfile "
        "--systemd-activation\n").encode())
    wants = unit_dir / "sockets.target.wants/dbus.socket"
    wants.parent.mkdir(parents=True, exist_ok=True)
    if not wants.is_symlink():
        wants.symlink_to(unit_dir / "dbus.socket")
    # A system-scope release's flatshare.target is WantedBy=multi-user.target, which a user manager has not: the
    # node's boot (its manager's start, default.target) pulls one in here, as a system manager's boot does.
    _write_if_changed(unit_dir / "multi-user.target", b"[Unit]\nDescription=The sandbox node's multi-user "
                      b"system (what a system-scope release is wanted by)\n")
    boot = unit_dir / "default.target.wants/multi-user.target"
    boot.parent.mkdir(parents=True, exist_ok=True)
    if not boot.is_symlink():
        boot.symlink_to(unit_dir / "multi-user.target")


def _wait_for_system_bus(node: SandboxNode, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until a system-scope node's manager answers on its bus: it takes the name
    org.freedesktop.systemd1 only once dbus.socket has started the bus, a moment after it starts.

    Raises:
        SandboxError: no answer there within ``timeout_s`` seconds.
    """
    def answers() -> bool:
        saved = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS")
        os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = f"unix:path={node.bus}"  # what the forked query reads
        try:
            systemd.properties(ManagerAddress("system"), [("", "Manager", "Version")], timeout_s=5.0)
            return True
        except systemd.SystemdError:
            return False
        finally:
            if saved is None:
                os.environ.pop("DBUS_SYSTEM_BUS_ADDRESS", None)
            else:
                os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = saved

    if not poll_until(answers, timeout_s, 0.2):
        raise SandboxError(f"{node.name}: its manager did not answer on its bus {node.bus} within {timeout_s:g} s")


def install_units(node: SandboxNode, units: dict[str, str]) -> list[str]:
    """Write the node's units (atomically, only those that changed); returns the names written."""
    written = []
    for name, text in units.items():
        if _write_if_changed(node.manager.unit_dir / name, text.encode()):
            written.append(name)
    return written


def up(base: Path, production: Path, addresses: dict[str, str] | None = None, echo=print,
       system_scope: tuple[str, ...] = (), bare: tuple[str, ...] = (), engine: str | None = None,
       release: bool = True) -> Path:
    """Bring the sandbox fleet up (idempotent): managers, sshd, each node's layout and profile.

    The nodes are brought up as bootstrapped nodes with no release (``bare`` ones as fresh nodes,
    for ``flatshare node bootstrap``); a node's first release is the real one (``flatshare release``,
    run here when ``release`` is true and a bootstrapped node has none: :func:`first_release`). A
    node that has a release keeps it (releases change it, not ``up``).

    Args:
        base: the sandbox directory (``.sandbox``).
        production: the production profile every node's profile extends (in a checkout: its root
            is what the first release renders).
        addresses: node name -> loopback address (default cyan 127.0.0.2, peacock 127.0.0.3).
        echo: where progress lines go.
        system_scope: nodes that get a bus of their own and are reached on the system-scope path.
        bare: fresh nodes (sshd, manager, engine venv only) for ``flatshare node bootstrap``.
        engine: ``vllm`` (vLLM 0.32.0's real engine, the checkout's ``.venv-vllm``) or ``stand-in``;
            None keeps what the sandbox was brought up with (``stand-in`` for a new one).
        release: run the first release on bootstrapped nodes without one (``flatshare sandbox up``
            does not: ``make demo``'s release is that first switch).

    Returns:
        The sandbox inventory's path.

    Raises:
        SandboxError, ProfileError, SystemdError: a step failed; the message names it.
    """
    vllm_release = load_profile(production).profile.engine.vllm_release  # refuse a bad profile before any change
    if engine is not None and engine not in node_profile.ENGINES:
        raise SandboxError(f"--engine: {engine!r} is not one of {', '.join(node_profile.ENGINES)}", exit_code=2)
    base = base.resolve()
    if base.exists() and not base.is_dir():
        raise SandboxError(f"{base}: not a directory; give the sandbox directory with --dir", exit_code=2)
    for node in nodes(base, addresses):
        refuse_long_socket_paths(node.manager)  # before anything is made
        _written_profiles(node.root / WRITTEN_PROFILES)
    base.mkdir(parents=True, exist_ok=True)
    with _sandbox_lock(base):
        recorded = _read_state(base).nodes  # a node keeps the options it was first brought up with
        system_scope = tuple(system_scope) or tuple(n for n, r in recorded.items() if r.scope == "system")
        bare = tuple(bare) or tuple(n for n, r in recorded.items() if r.bare)
        engine = engine or next((r.engine for r in recorded.values()), "stand-in")
        if engine == "vllm":
            _refuse_missing_engine_venv()
        for name, record in recorded.items():
            # A node that runs keeps what it was brought up as: remaking it in place would leave its
            # services running against a profile and a layout of another kind.
            want = ("system" if name in system_scope else "user", name in bare)
            running = _owns_manager(SandboxNode(name, "", base, record.scope, record.bare), record.manager_pid)
            if running and (record.scope, record.bare) != want:
                raise SandboxError(
                    f"{name}: already up as a {'bare ' if record.bare else ''}{record.scope}-scope node; bring "
                    f"the sandbox down first ('flatshare sandbox down --dir {base}') to bring it up as a "
                    f"{'bare ' if want[1] else ''}{want[0]}-scope node", exit_code=2)
        chosen = nodes(base, addresses, system_scope, bare, cast(Literal["vllm", "stand-in"], engine))  # one of ENGINES
        _refuse_other_addresses(base, chosen)
        _refuse_a_damaged_inventory(base)
        inventory, started = _up(base, production, chosen, vllm_release, echo)
        booting = [n for n in chosen if not n.bare and current_release(n.state_dir) is not None
                   and (n.name in started or _manager_state(n) in STARTING)]
        not_serving = _wait_for_start(booting, echo)
    waiting = [n for n in chosen if not n.bare and current_release(n.state_dir) is None]
    if release and waiting:
        first_release(inventory, production.resolve().parent.parent, [n.name for n in waiting], echo)
    elif waiting:
        echo(f"no release on {', '.join(n.name for n in waiting)} yet: its first is the real one "
             f"('flatshare release --all --inventory {inventory}')")
    if not_serving:
        raise SandboxError(f"{', '.join(not_serving)}: up, but its release does not serve (said above); "
                           f"'flatshare sandbox status --dir {base}' shows its units, {base}/NODE/var/log/flatshare/ "
                           "their output, and 'flatshare release' repairs a node that does not serve")
    return inventory


def _refuse_missing_engine_venv() -> None:
    """The real engine needs the checkout's .venv-vllm, built whole (its stamp written last).

    Raises:
        SandboxError: it is missing or half built; the message says how to build it.
    """
    venv = node_profile.engine_venv()
    if not (venv / ".complete").is_file() or not (venv / "bin/vllm").exists():
        raise SandboxError(f"--engine vllm: {venv} is not built (vLLM 0.32.0's CPU engine); run "
                           "scripts/vllm-venvs.sh (make demo and make test do), or use --engine stand-in", exit_code=2)


def first_release(inventory: Path, root: Path, names: list[str], echo=print) -> None:
    """The nodes' first release, the real one: ``flatshare release --node NAME`` from checkout ``root`` for
    each of ``names``, all at once (the node's switch installs and starts the units and writes the history;
    nothing here does). At once is safe: a node with no release takes no calls, so its switch drains nothing
    and asks no admission (README, "A node always takes calls"); each node's lines are echoed whole, in turn.

    Raises:
        SandboxError: a release did not succeed; the message ends with its last lines.
    """
    import tempfile

    started = []
    for name in names:
        command = [str(Path(sys.executable).parent / "flatshare"), "release", "--node", name, "--inventory",
                   str(inventory), "--root", str(root)]
        echo(f"first release: {' '.join(command[1:])}")
        output = tempfile.TemporaryFile("w+")
        started.append((name, subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True), output))
    failed = None
    for name, process, output in started:
        try:
            code = process.wait(timeout=1800)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        output.seek(0)
        text = output.read()
        output.close()
        for line in text.splitlines():
            echo(f"  {line}")
        if code not in (0, 4) and failed is None:
            tail = " | ".join(text.strip().splitlines()[-6:])
            failed = SandboxError(f"{name}: its first release exited {code}: {tail}")
    if failed is not None:
        raise failed


def _refuse_a_damaged_inventory(base: Path) -> None:
    """Refuse, before anything starts, an inventory ``up`` wrote before that it can no longer keep: not a
    regular file, not TOML, or against the inventory's schema (what an operator added to it is kept, so it
    is never silently replaced, and ``up`` never leaves one every later command refuses).

    Raises:
        SandboxError (exit 2): one line naming the file and what is wrong with it, and the way out.
    """
    from ..common.text import one_line as line_of
    from ..config.inventory import load_inventory
    from ..errors import FlatshareError

    path = base / "fleet.toml"
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_file():
        raise SandboxError(f"{path}: not a regular file; move it aside (sandbox up writes the sandbox's inventory "
                           "there)", exit_code=2)
    try:
        load_inventory(path)
    except FlatshareError as err:
        raise SandboxError(f"{line_of(str(err))}; fix it or move it aside (sandbox up keeps what was added to "
                           "the inventory it wrote, and writes a new one when there is none)", exit_code=2) from None


def _refuse_other_addresses(base: Path, sandbox_nodes: list[SandboxNode]) -> None:
    """Refuse, before anything starts, a sandbox directory whose nodes were made for other addresses: their
    installed release still serves on the old ones, and nothing would answer where 'up' then looks.

    Raises:
        SandboxError (exit 2): the message names the old address and the two ways out.
    """
    from urllib.parse import urlsplit

    from ..common.files import Damaged, read_json_object

    for node in sandbox_nodes:
        path = node.state_dir / "releases/current/serving.json"
        try:  # only a hint of the address it was made for (bounded, never blocking); the release's checks speak
            url = (read_json_object(path, allow_symlink=True) or {})["engine"]["url"]
            old = urlsplit(url).hostname
        except (Damaged, ValueError, KeyError, TypeError, AttributeError):
            continue  # no release yet, or one 'up' does not read: the release's own checks speak for it
        if old and old != node.address:
            raise SandboxError(
                f"{node.name}: {base} holds a node made for address {old} (its release serves {url}), not "
                f"{node.address}; use the same addresses (FLATSHARE_SANDBOX_ADDRESSES={node.name}={old},...) or "
                f"start afresh: 'flatshare sandbox down --dir {base}', then remove {base}", exit_code=2)


#: How long ``up`` waits for a booting node's release to serve (seconds): the gateway waits for the engine, and
#: a real engine's start takes 20-50 s here (its own bound, engine.start_timeout_s, is 120 s).
START_WAIT_S = 240.0
#: How a booting node's wait names its units seen stopping or starting again once they had served.
AGAIN = "stopped or started again while the others served: "
#: A manager's ``SystemState`` while its start-up transaction still has jobs (org.freedesktop.systemd1(5)).
STARTING = ("initializing", "starting")


def _manager_state(node: SandboxNode) -> str | None:
    """The node's manager's ``SystemState`` (``systemctl is-system-running``), or None when it does not answer."""
    try:
        found = systemd.properties(ManagerAddress("user", node.manager.runtime_dir), [("", "Manager", "SystemState")])
    except systemd.SystemdError:
        return None
    return str(found["/SystemState"])


def _serving_problems(node: SandboxNode) -> tuple[list[str], tuple, float]:
    """Why a node's release does not serve, as its callers would meet it (empty: it serves): each service unit
    active (systemd's ``ActiveState``), and the engine's and the gateway's ``/health`` answering 200. With the
    units' ``InvocationID`` (a new one for each start) and how long after its exit systemd starts a unit again
    (the longest ``RestartUSec``, seconds): a unit that exits at its start is ``active`` for a moment in each of
    its restarts, so a node serves only when its units kept their invocations that long."""
    queries = [(u, i, p) for u in SERVICE_UNITS
               for i, p in (("Unit", "ActiveState"), ("Unit", "InvocationID"), ("Service", "RestartUSec"))]
    try:
        found = systemd.properties(ManagerAddress("user", node.manager.runtime_dir), queries)
    except systemd.SystemdError as err:
        return [f"its manager does not answer ({err})"], (), 0.0
    problems = [f"{u} {found[f'{u}/ActiveState']}" for u in SERVICE_UNITS if found[f"{u}/ActiveState"] != "active"]
    invocations = tuple(str(found[f"{u}/InvocationID"]) for u in SERVICE_UNITS)
    restart_s = max(int(found[f"{u}/RestartUSec"]) for u in SERVICE_UNITS) / 1e6
    try:
        profile = load_profile(node.profile).profile
    except FlatshareError as err:
        return [*problems, f"its profile cannot be read ({err})"], invocations, restart_s
    for what, url in (("the engine", engine_url(profile)), ("the gateway", str(profile.gateway.url).rstrip("/"))):
        answered = http_get(url + "/health")[0]
        if answered != 200:
            problems.append(f"{what}'s {url}/health answered {answered or 'nothing'}")
    return problems, invocations, restart_s


def _wait_for_start(booting: list[SandboxNode], echo) -> list[str]:
    """Wait until each of ``booting`` (nodes with a release whose manager ``up`` started, as a machine boots, or
    whose manager is still starting its units) serves, and say where each stands; returns the names of those that
    do not serve by :data:`START_WAIT_S`.

    A node's manager starts its release's units by itself; until they serve, a release run meanwhile finds no
    node to keep serving while another drains. Serving is what callers meet, held past the units' restart delay
    (:func:`_serving_problems`), not that the manager has no job left: a service that exits at its start is
    started again by systemd for ever, never "failed". A manager that does not answer is asked again until the
    bound. Says, every ``progress_every()`` seconds (at least 15), what each node still waits for.
    """
    from ..common.poll import progress_every

    if not booting:
        return []
    echo(f"{', '.join(n.name for n in booting)}: each manager starts its release's units; waiting for them to serve "
         f"(up to {START_WAIT_S:g} s)")
    problems: dict[str, list[str]] = {n.name: ["not asked yet"] for n in booting}
    steady: dict[str, tuple[float, tuple]] = {}  # node -> (since when it served, with these invocations)
    again: dict[str, set[str]] = {n.name: set() for n in booting}  # node -> its units seen started again

    def served() -> bool:
        for node in booting:
            if not problems[node.name]:
                continue
            why, invocations, restart_s = _serving_problems(node)
            now = time.monotonic()
            if why:
                if node.name in steady:  # it served a moment ago: which units stopped serving since
                    again[node.name] |= {u for u in SERVICE_UNITS if any(w.startswith(f"{u} ") for w in why)}
                steady.pop(node.name, None)
                problems[node.name] = why
            elif steady.get(node.name, (0.0, None))[1] != invocations:
                before = steady.get(node.name, (0.0, ()))[1] or ()
                again[node.name] |= {u for u, was, now_ in zip(SERVICE_UNITS, before, invocations) if was != now_}
                steady[node.name] = (now, invocations)
                problems[node.name] = [f"its units are up and answer; watching {min(restart_s, 30.0) + 1.0:g} s (their "
                                       "restart delay) that none is started again"]
            elif now - steady[node.name][0] > min(restart_s, 30.0) + 1.0:
                problems[node.name] = []
            if problems[node.name] and again[node.name]:
                said = [w for w in problems[node.name] if not w.startswith(AGAIN)]
                problems[node.name] = [*said, AGAIN + ", ".join(sorted(again[node.name]))]
        return not any(problems.values())

    def progress(waited: float) -> None:
        for name, why in problems.items():
            if why:
                echo(f"{name}: not serving yet after {waited:.0f} s: {'; '.join(why)}")

    poll_until(served, START_WAIT_S, 0.5, progress, max(progress_every(), 15.0))
    for node in booting:
        echo(f"{node.name}: its release serves (its units active, the engine and the gateway answer /health)"
             if not problems[node.name] else
             f"{node.name}: its release does not serve after {START_WAIT_S:g} s: {'; '.join(problems[node.name])}")
    return [name for name, why in problems.items() if why]


def _up(base: Path, production: Path, sandbox_nodes: list[SandboxNode], release: str,
        echo) -> tuple[Path, list[str]]:
    """Make each node's layout, start what is not running; (the inventory, the nodes whose manager was started)."""
    models = _models(base, sandbox_nodes, echo)
    for node in sandbox_nodes:
        for directory in (node.state_dir, node.run_dir, node.ssh_dir, node.output_dir):
            directory.mkdir(parents=True, exist_ok=True)
        if write_node_profile(node, production.resolve(), release):
            echo(f"{node.name}: {node.profile} was changed since sandbox up wrote it; kept as it is (move it aside "
                 "to have sandbox up write it afresh)")
        make_engine_venv(node, release)
        for variant in variant_profiles(production):
            # A variant on another vLLM release gets its own engine venv, side by side (as on a real node);
            # there is no real engine of another release here: a variant runs the stand-in.
            other = load_profile(variant).profile.engine.vllm_release
            venv_dir = node.venv if other == release else node.venv.with_name(f"engine-venv-{other}")
            if other != release:
                make_engine_venv(node, other, venv_dir)
            if write_node_profile(node, variant.resolve(), other, venv_dir, node.variant_profile(variant), "stand-in"):
                echo(f"{node.name}: {node.variant_profile(variant)} was changed since sandbox up wrote it; kept as it "
                     "is (move it aside to have sandbox up write it afresh)")
        # What production keeps beside the engine: the model's directory and the card's step-time model.
        _write_if_changed(node.state_dir / "models/flatshare-chat/config.json",
                          b'{"stand_in": true, "max_position_embeddings": 16384}\n')
        if node.engine == "vllm":
            _copy_model(models, node.model)
        _write_if_changed(node.state_dir / "step-time/rtx-5060-ti.json", b'{"stand_in": true}\n')
    sshd_changed = write_ssh_files(base, sandbox_nodes)
    inventory = write_inventory(base, sandbox_nodes)

    state = _read_state(base)
    started: list[str] = []
    for node in sandbox_nodes:
        record = state.nodes.setdefault(node.name, NodeRecord())
        record.scope, record.bare, record.engine = node.scope, node.bare, node.engine
        manager_ok = _owns_manager(node, record.manager_pid) and _manager_answers(node)
        sshd_ok = _owns_sshd(node, record.sshd_pid)
        if sshd_ok and node.name in sshd_changed:  # started again on the sshd_config just written
            assert record.sshd_pid is not None  # sshd_ok: it is this node's sshd
            _stop(record.sshd_pid)
            sshd_ok = False
        if not manager_ok and not sshd_ok:
            _refuse_taken_ports(node)
        if not manager_ok:
            if node.scope == "system":
                write_system_bus(node)
            record.manager_pid = start_manager(node.manager, _manager_env(node))
            _write_state(base, state)  # recorded at once, so 'down' can stop it whatever happens next
            if node.scope == "system":
                _wait_for_system_bus(node)
            echo(f"{node.name}: systemd user manager started (pid {record.manager_pid})")
            started.append(node.name)
        if not sshd_ok:
            if _listening(node.address, SSH_PORT):
                raise SandboxError(f"{node.name}: {node.address}:{SSH_PORT} is already in use by another process")
            record.sshd_pid = _start_sshd(node)
            _write_state(base, state)
            echo(f"{node.name}: sshd listening on {node.address}:{SSH_PORT} (pid {record.sshd_pid})")
        _write_state(base, state)

    for node in sandbox_nodes:
        if node.bare:
            echo(f"{node.name}: bare: sshd, its manager and an engine venv; bootstrap it ('flatshare node bootstrap')")
            continue
        _build_module(node)
        if node.engine == "vllm":
            echo(f"{node.name}: vLLM 0.32.0's real engine ({node_profile.engine_venv()}), model {node.model}; "
                 "what the CPU engine cannot run is overridden:")
            for override in node_profile.overrides_for(node.engine):
                echo(f"  {override.key} = {json.dumps(override.value)}: {override.reason}")
        else:
            echo(f"{node.name}: the stand-in engine")
    return inventory, started


def _models(base: Path, sandbox_nodes: list[SandboxNode], echo) -> Path | None:
    """The tiny model (:func:`tiny_model`) when a node runs the real engine, else None."""
    if not any(n.engine == "vllm" for n in sandbox_nodes):
        return None
    return tiny_model(base, echo)


def tiny_model(base: Path, echo=print) -> Path:
    """The tiny model, made once per sandbox (``BASE/models/tiny-llama``) by the real engine venv's Python.

    Raises:
        SandboxError: making it failed.
    """
    made = base / "models" / node_profile.TINY_MODEL
    weights = made / "model.safetensors"
    if weights.is_file() and weights.stat().st_mode & 0o004 == 0:
        weights.chmod(0o644)  # made 0600 by an earlier flatshare-ops: the machines' engine runs as the service user
    if not weights.is_file():
        python = node_profile.engine_venv() / "bin/python"
        script = Path(__file__).with_name("tiny_model.py")
        echo(f"making the tiny model {made} (random weights, a word-level tokenizer: nothing downloaded)")
        done = subprocess.run([str(python), "-P", str(script), str(made)], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-4:])
            raise SandboxError(f"making the tiny model failed (exit {done.returncode}): {tail}")
    return made


def _copy_model(models: Path | None, target: Path) -> None:
    if models is None or (target / "model.safetensors").is_file():
        return
    scratch = target.with_name(target.name + ".tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(models, scratch)
    os.replace(scratch, target)


def _build_module(node: SandboxNode) -> None:
    """Build the node's serve module once, as bootstrap does (the preflight imports it before the first start).

    Raises:
        SandboxError: the build failed.
    """
    from ..common.hashing import sha256_file

    module = load_profile(node.profile).profile.module
    if Path(module.path).is_file() and (current_release(node.state_dir) is not None
                                         or sha256_file(Path(module.path)) == module.sha256):
        return  # built (a serving node's module is never rebuilt under its engine)
    done = subprocess.run(list(module.build_command), capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not Path(module.path).is_file():
        raise SandboxError(f"{node.name}: the serve module's build failed (exit {done.returncode}): "
                           f"{clip_tail(done.stderr.strip(), 300)}")


def status(base: Path) -> dict[str, dict]:
    """Each node's processes and unit states.

    Returns:
        node -> {"manager": bool, "sshd": bool, "release": str | None, "units": {unit: ActiveState},
        "engine_pid": int, "engine_health": int | None}.
    """
    base = base.resolve()
    state = _read_state(base)
    report: dict[str, dict] = {}
    for name, record in state.nodes.items():
        node = SandboxNode(name, "", base)
        entry: dict = {
            "manager": _owns_manager(node, record.manager_pid),
            "sshd": _owns_sshd(node, record.sshd_pid),
            "release": current_release(node.state_dir),
            "units": {},
            "engine_pid": 0,
            "engine_health": None,
        }
        if entry["manager"] and _manager_answers(node):
            names = (TARGET_UNIT, *SERVICE_UNITS)
            found = systemd.properties(ManagerAddress("user", node.manager.runtime_dir),
                                       [(u, "Unit", "ActiveState") for u in names] + [(ENGINE_UNIT, "Service", "MainPID")])
            entry["units"] = {u: found[f"{u}/ActiveState"] for u in names}
            entry["engine_pid"] = found[f"{ENGINE_UNIT}/MainPID"]
            if node.profile.exists():
                status_code = http_get(engine_url(load_profile(node.profile).profile) + "/health")[0]
                entry["engine_health"] = status_code or None
        report[name] = entry
    return report


def reboot(base: Path, name: str, echo=print) -> int:
    """Reboot a sandbox node's systemd: stop its manager and everything it runs, clear its runtime
    directory (as a boot clears /run), start the manager again, and start nothing by hand: what
    comes up is what is enabled. Returns the new manager's pid.

    Raises:
        SandboxError: no such node in this sandbox, or the manager did not come back.
    """
    import shutil

    base = base.resolve()
    with _sandbox_lock(base):
        state = _read_state(base)
        if name not in state.nodes:
            raise SandboxError(f"{base}: no sandbox node {name!r}; nodes: {', '.join(state.nodes)}", exit_code=2)
        record = state.nodes[name]
        node = SandboxNode(name, "", base, record.scope, record.bare)
        owned = _owns_manager(node, record.manager_pid)
        stop_manager(node.manager.name, record.manager_pid if owned else None)
        for entry in node.manager.runtime_dir.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        record.manager_pid = start_manager(node.manager, _manager_env(node))
        _write_state(base, state)
        echo(f"{name}: systemd user manager rebooted (pid {record.manager_pid}); nothing started by hand")
        return record.manager_pid


def down(base: Path, echo=print) -> None:
    """Stop every process the sandbox started; leaves the files for the next ``up``.

    A recorded process id is signalled only if it still is this sandbox's
    process (its sshd_config on the command line; a ``systemd --user`` in the
    node's own cgroup), so a reused id is never touched. Whatever is left in
    the node's cgroups is killed.
    """
    base = base.resolve()
    if not base.exists():
        echo(f"{base}: no sandbox here")
        return
    with _sandbox_lock(base):
        state = _read_state(base)
        for name, record in state.nodes.items():
            node = SandboxNode(name, "", base)
            if _owns_sshd(node, record.sshd_pid):
                assert record.sshd_pid is not None  # it is this node's sshd
                _stop(record.sshd_pid)
                echo(f"{name}: sshd stopped (pid {record.sshd_pid})")
            elif record.sshd_pid:
                echo(f"{name}: sshd pid {record.sshd_pid} is gone or no longer ours; not touched")
            owned = _owns_manager(node, record.manager_pid)
            stop_manager(node.manager.name, record.manager_pid if owned else None)
            echo(f"{name}: systemd user manager and its units stopped"
                 + (f" (pid {record.manager_pid})" if owned else " (its cgroup swept)"))
        (base / "state.json").unlink(missing_ok=True)


def _stop(pid: int) -> None:
    """SIGTERM to ``pid``, then wait for it to be gone (SIGKILL after 10 s)."""
    os.kill(pid, signal.SIGTERM)
    _wait_gone(pid)


def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    if not poll_until(lambda: not pid_alive(pid), timeout_s):
        os.kill(pid, signal.SIGKILL)
