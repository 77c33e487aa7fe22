"""``flatshare node bootstrap``: bring a node from sshd and an engine venv to ready for its first release.

Idempotent, over SSH, ``--dry-run`` changes nothing. It ends with what it
checked, one line each (``ok``, ``done``, ``would``, ``FAIL`` with how to fix
it); the first ``flatshare release`` then installs the units. In order:

1. the host key: verified against the fleet's known_hosts; an unknown key is
   shown by its SHA256 fingerprint and added only with ``--accept-host-key
   SHA256:...`` matching it: never trusted on first use silently;
2. the node's platform (Debian release, Python version, architecture) equals
   the operator machine's, which builds the node's wheels (control/wheels.py);
3. the node layout from the profile: state, unit and module directories, the
   service user (system scope) and the module directory's owner;
4. flatshare-ops' node side: the wheels shipped over SFTP, installed into
   ``OPS/.venv`` with ``pip install --no-index --require-hashes``, and the
   requirements.lock they came from kept beside it (node/entry.py checks
   each release's switcher against it);
5. the engine venv holds the profile's vLLM release; the model path exists;
6. the module's build command runs once; the built module's sha256 is reported
   (pin it: ``flatshare profiles pin-module --from-node NODE``).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import cast

import paramiko

from ..errors import Exit, FlatshareError, TransportError
from . import known_hosts as known_hosts_file
from ..render.units import engine_home, service_user
from .ssh import SSHConnection
from .targets import NodeTarget
from ..common.text import clip_tail

#: node_exporter's textfile directory's mode: group-writable for the service user's group, and sticky (a member
#: may replace only the files it owns; chmod(1), "RESTRICTED DELETION FLAG").
TEXTFILE_MODE = 0o1775
#: A shared library vLLM's extension modules link against -> the Debian package that provides it.
SYSTEM_LIBRARIES = {"libnuma.so.1": "libnuma1", "libgomp.so.1": "libgomp1", "libstdc++.so.6": "libstdc++6"}


def textfile_directory(check_command: list[str]) -> str | None:
    """The directory serving-check's command writes its textfile to (``--textfile DIR`` or ``--textfile=DIR``)."""
    for i, word in enumerate(check_command):
        if word == "--textfile" and i + 1 < len(check_command):
            return check_command[i + 1]
        if word.startswith("--textfile="):
            return word.split("=", 1)[1]
    return None

#: Read on the node by its own python3 (standard library only): what bootstrap needs to know.
FACTS = r"""
import hashlib, json, os, platform, pwd, shutil, sys, sysconfig
want = json.loads(sys.argv[1])
release = {}
try:
    for line in open("/etc/os-release"):
        k, _, v = line.strip().partition("=")
        release[k] = v.strip('"')
except OSError:
    pass
def vllm(venv):
    import glob
    for meta in sorted(glob.glob(os.path.join(venv, "lib/python*/site-packages/vllm-*.dist-info/METADATA"))):
        for line in open(meta, errors="replace"):
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None
def lock(path):
    try:
        return hashlib.sha256(open(path, "rb").read()).hexdigest()
    except OSError:
        return None
try:
    import ensurepip, venv as _venv
    has_venv = True
except ImportError:
    has_venv = False
user = want.get("user")
try:
    pwd.getpwnam(user) if user else None
    user_exists = bool(user)
except KeyError:
    user_exists = False
def missing_libraries(venv):
    # The shared libraries vLLM's extension modules link against that neither the system (ldd) nor the venv
    # (torch/lib, auditwheel's PKG.libs: found at import, not by ldd) provides.
    import glob, subprocess
    sites = glob.glob(os.path.join(venv, "lib/python*/site-packages"))
    if not sites:
        return []
    site, own, dirs = sites[0], set(), []
    for path, _, files in os.walk(site):
        found = [f for f in files if ".so" in f]
        own.update(found)
        if found:
            dirs.append(path)
    missing = set()
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LD_LIBRARY_PATH": ":".join(dirs)}
    for so in sorted(glob.glob(os.path.join(site, "vllm", "*.so"))):
        try:
            out = subprocess.run(["ldd", so], capture_output=True, text=True, timeout=60, env=env).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for line in out.splitlines():
            name, _, where = line.strip().partition(" => ")
            if where.strip() == "not found" and name not in own:
                missing.add(name)
    return sorted(missing)
def directory(path):
    import grp, stat, subprocess
    try:
        st = os.stat(path)
    except OSError:
        return None
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    try:
        dpkg = subprocess.run(["dpkg-query", "-S", path], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        dpkg = False
    return {"uid": st.st_uid, "group": group, "mode": stat.S_IMODE(st.st_mode), "dpkg": dpkg}
def owner(path):
    import pwd
    try:
        uid = os.lstat(path).st_uid
    except OSError:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
def group_exists(name):
    import grp
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False
build = want["build"]
print(json.dumps({
    "platform": {"os": release.get("ID", "?"), "os_version": release.get("VERSION_ID", "?"),
                 "python": "%d.%d" % sys.version_info[:2], "machine": platform.machine()},
    "python3": sys.executable, "has_venv": has_venv,
    "dirs": {p: os.path.isdir(p) for p in want["dirs"]},
    "model": os.path.exists(want["model"]) if want["model"].startswith("/") else True,
    "vllm": vllm(want["venv"]),
    "build": os.path.isfile(build) and os.access(build, os.X_OK),
    "module": os.path.isfile(want["module"]),
    "user_exists": user_exists,
    "installed_lock": lock(os.path.join(want["ops"], "requirements.lock")),
    "entry": os.access(os.path.join(want["ops"], ".venv/bin/flatshare-node"), os.X_OK),
    "missing_libraries": missing_libraries(want["venv"]),
    "textfile": directory(want["textfile"]) if want["textfile"] else None,
    "textfile_owner": owner(os.path.join(want["textfile"], "serving_check.prom")) if want["textfile"] else None,
    "journal_group": group_exists("systemd-journal"),
    "compilers": [c for c in ("cc", "gcc", "g++") if shutil.which(c)],
    "python_headers": os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
}))
"""


class Bootstrap:
    """One node's bootstrap: each item checked or done, one line each.

    Args:
        target: the node.
        root: the checkout (its requirements.lock and code build the node's wheels).
        echo: where lines go.
        dry_run: check and say what would be done; change nothing.
        accept_host_key: ``SHA256:...``, the fingerprint the operator checked on the node.
    """

    def __init__(self, target: NodeTarget, root: Path, echo, dry_run: bool = False,
                 accept_host_key: str | None = None) -> None:
        self.target, self.root, self.echo, self.dry_run, self.accept = target, Path(root), echo, dry_run, accept_host_key
        self.failed = 0
        self.conn: SSHConnection | None = None
        self.accepted: str | None = None  # a dry run's accepted key, trusted for this run only
        profile = target.loaded.profile
        self.profile = profile
        check = Path(profile.check.command[0])
        if check.parent.name != "bin" or check.parent.parent.name != ".venv":
            raise FlatshareError(f"{target.profile_path}: check.command[0] must be OPS/.venv/bin/serving-check "
                                 f"(bootstrap installs flatshare-ops into OPS/.venv), got {check}")
        self.ops = check.parent.parent.parent

    def line(self, state: str, item: str, detail: str) -> None:
        """One line of the report; ``FAIL`` lines count."""
        if state == "FAIL":
            self.failed += 1
        self.echo(f"  {state:5} {item}: {detail}")

    def run(self) -> int:
        """Bootstrap the node. Returns ``Exit.OK`` when every item is ok or done, ``Exit.REFUSED`` otherwise."""
        self.echo(f"{self.target.name}: bootstrap" + (" (dry run: nothing is changed)" if self.dry_run else ""))
        if not self._host_key():
            return self._end()
        try:
            self.conn = self._connect()
        except TransportError as err:
            self.line("FAIL", "ssh", str(err))
            return self._end()
        try:
            facts = self._facts()
            if facts is not None and self._platform(facts):
                self._layout(facts)
                self._install(facts)
                self._engine(facts)
                self._module(facts)
        finally:
            self.conn.close()
        return self._end()

    def _connect(self) -> SSHConnection:
        if self.accepted is None:
            return cast(SSHConnection, self.target.connect())  # a named node (--node): never local, so over SSH
        import tempfile

        from dataclasses import replace

        path = self._known_hosts_path()
        with tempfile.NamedTemporaryFile("w", suffix=".known_hosts", delete=False) as scratch:
            scratch.write(known_hosts_file.with_entry(path, self.accepted))
        try:
            return SSHConnection(replace(self.target.ssh_target, known_hosts=Path(scratch.name)))
        finally:
            Path(scratch.name).unlink()

    def _end(self) -> int:
        if self.failed:
            self.echo(f"{self.target.name}: {self.failed} item(s) to fix first (see FAIL above); then run bootstrap again")
            return Exit.REFUSED
        self.echo(f"{self.target.name}: " + ("bootstrap would succeed" if self.dry_run else
                                              "bootstrapped; 'flatshare release' installs or updates the units"))
        return Exit.OK

    # --- 1. the host key ------------------------------------------------------------------------------

    def _known_hosts_path(self) -> Path:
        from ..config.inventory import resolve

        path = resolve(self.target.inventory, self.target.node.known_hosts)
        return path or Path.home() / ".ssh" / "known_hosts"

    def _host_key(self) -> bool:
        from .ssh import open_socket

        try:
            n = self.target.ssh_target  # the node's host, port and jump, the operator's SSH config applied
        except FlatshareError as err:
            self.line("FAIL", "ssh", str(err))
            return False
        path = self._known_hosts_path()
        label = known_hosts_file.host_label(n.host, n.port)
        transport = jump = None
        try:
            sock, jump = open_socket(n)
            transport = paramiko.Transport(sock)
            transport.banner_timeout = n.connect_timeout_s
            transport.start_client(timeout=n.connect_timeout_s)
            key = transport.get_remote_server_key()
        except TransportError as err:  # the host, or its jump host, not reached (or the jump's key refused)
            self.line("FAIL", "ssh", str(err))
            return False
        except (OSError, paramiko.SSHException, EOFError) as err:
            self.line("FAIL", "ssh", f"no SSH handshake with {label} within {n.connect_timeout_s:g} s ({err})")
            return False
        finally:
            if transport is not None:
                transport.close()
            if jump is not None:
                jump.close()
        fingerprint = known_hosts_file.fingerprint(key.asbytes())
        known = known_hosts_file.read(path) if path.exists() else known_hosts_file.KnownHosts(path)
        try:
            known_hosts_file.verify(known, self.target.name, n.host, n.port, key.get_name(), key.asbytes())
            self.line("ok", "host key", f"{label} {key.get_name()} {fingerprint} is in {path}")
            return True
        except TransportError as err:
            if "is not in" not in str(err):
                self.line("FAIL", "host key", str(err))
                return False
        if self.accept is None:
            self.line("FAIL", "host key", f"{label} is not in {path}; its key is {key.get_name()} {fingerprint}. "
                      f"Check it on the node (ssh-keygen -lf /etc/ssh/ssh_host_{key.get_name().split('-')[-1]}_key.pub), "
                      f"then run again with --accept-host-key {fingerprint}")
            return False
        if self.accept != fingerprint:
            self.line("FAIL", "host key", f"{label} presents {fingerprint}, not the {self.accept} you accepted; "
                      "refusing (a different machine answers, or the fingerprint was mistyped)")
            return False
        entry = f"{label} {key.get_name()} {key.get_base64()}\n"
        if self.dry_run:
            self.line("would", "host key", f"add {label} {fingerprint} to {path}")
            self.accepted = entry
            return True
        path.parent.mkdir(parents=True, exist_ok=True)
        from ..common import durable

        durable.write_atomic(path, known_hosts_file.with_entry(path, entry).encode())
        try:  # read back as every later connection will read it
            known_hosts_file.verify(known_hosts_file.read(path), self.target.name, n.host, n.port, key.get_name(),
                                    key.asbytes())
        except TransportError as err:
            self.line("FAIL", "host key", f"wrote {label} to {path}, but it does not read back: {err}")
            return False
        self.line("done", "host key", f"added {label} {key.get_name()} {fingerprint} to {path} (commit it)")
        return True

    # --- 2. facts and platform ------------------------------------------------------------------------

    def _run(self, argv: list[str], timeout_s: float = 120.0) -> tuple[int | None, str]:
        assert self.conn is not None  # run() connects before any item
        result = self.conn.run(argv, timeout_s=timeout_s)
        return result.status, result.output

    def _facts(self) -> dict | None:
        p = self.profile
        want = {"dirs": [p.layout.state_dir, p.layout.unit_dir, p.module.directory, engine_home(p), str(self.ops)],
                "model": p.engine.model, "venv": p.engine.venv, "build": p.module.build_command[0],
                "module": p.module.path, "user": service_user(p), "ops": str(self.ops),
                "textfile": textfile_directory(p.check.command)}
        status, output = self._run(["python3", "-c", FACTS, json.dumps(want)])
        try:
            return json.loads(output)
        except ValueError:
            self.line("FAIL", "python3", f"the node's python3 could not report its facts (exit {status}: "
                      f"{clip_tail(output.strip(), 200)}); install Debian's python3 and python3-venv")
            return None

    def _platform(self, facts: dict) -> bool:
        from .wheels import local_platform

        here, there = local_platform(), facts["platform"]
        if here != there:
            self.line("FAIL", "platform", f"the node runs {there}, the wheels are built here for {here}; bootstrap "
                      "from an operator machine with the node's Debian release, Python and architecture")
            return False
        self.line("ok", "platform", f"{there['os']} {there['os_version']}, Python {there['python']}, {there['machine']}")
        if not facts["has_venv"]:
            self.line("FAIL", "python3-venv", "the node's python3 cannot make a venv: apt-get install python3-venv")
            return False
        return True

    # --- 3. layout --------------------------------------------------------------------------------------

    def _layout(self, facts: dict) -> None:
        p = self.profile
        missing = [d for d, there in facts["dirs"].items() if not there]
        if missing:
            if self.dry_run:
                self.line("would", "layout", f"create {', '.join(missing)}")
            else:
                status, output = self._run(["mkdir", "-p", *missing])
                self.line("done" if status == 0 else "FAIL", "layout",
                          f"created {', '.join(missing)}" if status == 0 else clip_tail(output.strip(), 200))
        else:
            self.line("ok", "layout", "state, unit and module directories exist")
        user = service_user(p)
        if not user:
            self.line("ok", "service user", f"scope {p.layout.scope}: the services run as the manager's user")
            return
        if not facts["user_exists"]:
            if self.dry_run:
                self.line("would", "service user", f"create system user {user}")
            else:
                status, output = self._run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                                            user])
                self.line("done" if status == 0 else "FAIL", "service user",
                          f"created system user {user}" if status == 0 else clip_tail(output.strip(), 200))
        else:
            self.line("ok", "service user", f"{user} exists")
        owned = f"{p.module.directory} (the engine builds its module there) and {engine_home(p)} (the engine's " \
                "HOME: vLLM's caches)"
        if self.dry_run:
            self.line("would", "ownership", f"give {user} {owned}")
        else:
            status, output = self._run(["chown", "-R", f"{user}:", p.module.directory, engine_home(p)])
            self.line("done" if status == 0 else "FAIL", "ownership",
                      f"{user} owns {owned}" if status == 0 else clip_tail(output.strip(), 200))
        self._textfile(facts, user)
        if facts.get("journal_group"):
            self.line("ok", "journal", f"serving-check runs as {user} in the group systemd-journal (its unit's "
                      "SupplementaryGroups=): it reads the engine's lines from the journal")
        else:
            self.line("FAIL", "journal", "the node has no group systemd-journal, which serving-check's unit joins "
                      "to read the engine's lines: is systemd's journald installed (Debian's systemd package)?")

    def _textfile(self, facts: dict, user: str) -> None:
        """node_exporter's textfile directory, where serving-check (as ``user``) writes serving_check.prom: owned
        by root, its group ``user``'s, mode 1775 (group-writable and sticky: the user may add files and replace
        its own, never another's). A directory a Debian package owns (prometheus-node-exporter makes it root:root
        0755) gets it through ``dpkg-statoverride``, which package upgrades keep."""
        directory = textfile_directory(self.profile.check.command)
        if directory is None:
            self.line("ok", "textfile", "serving-check's command writes no textfile (no --textfile)")
            return
        found = facts.get("textfile")
        if found and found["uid"] == 0 and found["group"] == user and found["mode"] == TEXTFILE_MODE:
            self.line("ok", "textfile", f"{directory} is root:{user} {TEXTFILE_MODE:o}: serving-check writes there "
                      "as " + user)
            self._textfile_owner(facts, directory, user)
            return
        if found is None:
            what, argv = "create", ["install", "-d", "-o", "root", "-g", user, "-m", f"{TEXTFILE_MODE:o}", directory]
        elif found["dpkg"]:
            what = "override (dpkg-statoverride)"
            argv = ["sh", "-c", "dpkg-statoverride --list \"$1\" >/dev/null && dpkg-statoverride --remove \"$1\"; "
                    "dpkg-statoverride --update --add root \"$2\" \"$3\" \"$1\"", "sh", directory, user,
                    f"{TEXTFILE_MODE:o}"]
        else:
            what = "set"
            argv = ["sh", "-c", 'chown root:"$2" "$1" && chmod "$3" "$1"', "sh", directory, user, f"{TEXTFILE_MODE:o}"]
        if self.dry_run:
            self.line("would", "textfile", f"{what} {directory} as root:{user} {TEXTFILE_MODE:o} (node_exporter's "
                      f"textfile directory; serving-check writes there as {user})")
            return
        status, output = self._run(argv)
        self.line("done" if status == 0 else "FAIL", "textfile",
                  f"{what} {directory} as root:{user} {TEXTFILE_MODE:o}: serving-check writes there as {user}"
                  if status == 0 else f"{directory}: {clip_tail(output.strip(), 200)}")
        if status == 0:
            self._textfile_owner(facts, directory, user)

    def _textfile_owner(self, facts: dict, directory: str, user: str) -> None:
        """serving_check.prom itself: another user's (root's, from a run of serving-check in root's crontab) can
        never be replaced by the timer's runs as ``user`` in the sticky directory, and node_exporter would read
        that stale file for good: it is given to ``user``."""
        found = facts.get("textfile_owner")
        path = f"{directory}/serving_check.prom"
        if found is None or found == user:
            return
        if self.dry_run:
            self.line("would", "textfile", f"give {path} to {user} (it is {found}'s: serving-check's runs as {user} "
                      "could not replace it)")
            return
        status, output = self._run(["chown", "-h", f"{user}:{user}", path])
        self.line("done" if status == 0 else "FAIL", "textfile",
                  f"{path} was {found}'s (a run of serving-check as {found}, from its crontab?): now {user}'s, so the "
                  f"timer's runs replace it" if status == 0 else f"{path}: {clip_tail(output.strip(), 200)}")

    # --- 4. flatshare-ops on the node -----------------------------------------------------------------

    def _install(self, facts: dict) -> None:
        import hashlib

        from .wheels import build, project_dir

        lock = project_dir(self.root) / "requirements.lock"
        want = hashlib.sha256(lock.read_bytes()).hexdigest()
        if self.dry_run:
            state = "ok" if facts["installed_lock"] == want and facts["entry"] else "would"
            self.line(state, "flatshare-ops", f"{'installed from' if state == 'ok' else 'install into'} {self.ops}/.venv "
                      f"(requirements.lock {want[:12]})")
            return
        wheels = build(self.root, echo=self.echo)
        try:
            self._ship(wheels, lock)
        finally:
            import shutil

            shutil.rmtree(wheels.directory, ignore_errors=True)  # the per-run set (the dependencies stay cached)

    def _ship(self, wheels, lock: Path) -> None:
        import hashlib

        want = hashlib.sha256(lock.read_bytes()).hexdigest()
        remote = self.ops / "wheels"
        self._run(["mkdir", "-p", str(remote)])
        assert self.conn is not None  # run() connects before any item
        sftp = self.conn.transport.open_sftp_client()
        channel = sftp.get_channel()
        assert channel is not None  # a client opened on a transport has its channel
        try:
            channel.settimeout(120)
            present = set(sftp.listdir(str(remote)))
            for name in (*wheels.files, "requirements.node.lock", "requirements.self.lock"):
                if name.endswith(".whl") and name in present and not name.startswith("flatshare_ops-"):
                    continue  # a dependency's wheel name carries its version; the lock checks its bytes
                sftp.put(str(wheels.directory / name), str(remote / name))
            sftp.put(str(lock), str(self.ops / "requirements.lock.new"))
        finally:
            sftp.close()
        venv = self.ops / ".venv"
        pip = [str(venv / "bin/pip"), "install", "--quiet", "--no-index", "--require-hashes", "--find-links", str(remote)]
        script = " && ".join([
            f"{{ test -x {shlex.quote(str(venv / 'bin/python'))} || python3 -m venv {shlex.quote(str(venv))}; }}",
            shlex.join([*pip, "-r", str(remote / "requirements.node.lock")]),
            shlex.join([*pip, "--no-deps", "--force-reinstall", "-r", str(remote / "requirements.self.lock")]),
            shlex.join(["mv", str(self.ops / "requirements.lock.new"), str(self.ops / "requirements.lock")]),
        ])
        status, output = self._run(["sh", "-c", script], timeout_s=600)
        if status != 0:
            self.line("FAIL", "flatshare-ops", f"the install into {venv} failed (exit {status}): {clip_tail(output.strip(), 300)}")
            return
        self.line("done", "flatshare-ops", f"installed into {venv} from {len(wheels.files)} wheels "
                  f"(requirements.lock {want[:12]}, --no-index --require-hashes)")

    # --- 5. the engine, 6. the module -------------------------------------------------------------------

    def _engine(self, facts: dict) -> None:
        from ..common.vllm_release import same_release

        e = self.profile.engine
        if facts["vllm"] and same_release(facts["vllm"], e.vllm_release):
            self.line("ok", "engine venv", f"{e.venv} holds vLLM {facts['vllm']} (release {e.vllm_release})")
        else:
            self.line("FAIL", "engine venv", f"{e.venv} holds vLLM {facts['vllm'] or 'nothing'}, the profile needs "
                      f"{e.vllm_release}: install it ({e.venv}/bin/pip install vllm=={e.vllm_release}), then build "
                      "make-room against it")
        missing = facts.get("missing_libraries") or []
        if missing:
            packages = sorted({SYSTEM_LIBRARIES.get(name, "") for name in missing} - {""})
            unknown = [name for name in missing if name not in SYSTEM_LIBRARIES]
            how = (f"apt-get install {' '.join(packages)}" if packages else "") + \
                (("; " if packages else "") + f"install the packages that provide {', '.join(unknown)} "
                 "(apt-file search NAME)" if unknown else "")
            self.line("FAIL", "engine libraries", f"vLLM in {e.venv} links against {', '.join(missing)}, which this "
                      f"node lacks: {how}")
        else:
            self.line("ok", "engine libraries", f"every shared library vLLM's extension modules in {e.venv} link "
                      "against is on the node (ldd)")
        if not e.enforce_eager:
            # torch.compile builds kernels when the engine starts: Triton compiles its launcher with the C compiler
            # on a GPU, inductor's C++ backend needs g++ on a CPU; both include Python.h.
            missing = ([] if facts.get("compilers") else ["gcc", "g++"]) + \
                ([] if facts.get("python_headers") else ["python3-dev"])
            if missing:
                self.line("FAIL", "compiler", "engine.enforce_eager = false: torch.compile builds kernels at the "
                          "engine's start with the C compiler and Python's headers, which the node lacks: "
                          f"apt-get install {' '.join(missing)}")
            else:
                self.line("ok", "compiler", f"{', '.join(facts['compilers'])} and Python.h for torch.compile "
                          "(engine.enforce_eager = false) at the engine's start")
        if facts["model"]:
            self.line("ok", "model", f"{e.model} exists")
        else:
            self.line("FAIL", "model", f"{e.model} does not exist: copy the model's files there")

    def _module(self, facts: dict) -> None:
        m = self.profile.module
        if not facts["build"]:
            self.line("FAIL", "module", f"the build command {m.build_command[0]} is missing or not executable")
            return
        if facts.get("module"):
            # Built already (by a bootstrap or the engine's own pre-start step): never rebuilt under a running
            # engine, which serving-check would then rightly call CRITICAL (a module newer than the engine).
            status, output = self._run(["sha256sum", m.path])
            built: str | None = output.split()[0] if status == 0 and output.split() else "?"
            pinned = "as the profile pins" if built == m.sha256 else (
                f"the profile pins {m.sha256[:12]}...: pin it with 'flatshare profiles pin-module --from-node "
                f"{self.target.name}', commit, then release")
            self.line("ok", "module", f"{m.path} is built: sha256 {built}, {pinned} (not rebuilt)")
            return
        if self.dry_run:
            self.line("would", "module", f"run {shlex.join(m.build_command)} once and report the module's sha256")
            return
        user = service_user(self.profile)
        command = (["runuser", "-u", user, "--"] if user else []) + list(m.build_command)
        env = ["env", f"PYTHONPATH={m.directory}"]
        status, output = self._run([*env, *command], timeout_s=600)
        if status != 0:
            self.line("FAIL", "module", f"the build failed (exit {status}): {clip_tail(output.strip(), 300)}")
            return
        status, output = self._run(["sha256sum", m.path])
        built = output.split()[0] if status == 0 and output.split() else None
        if built is None:
            self.line("FAIL", "module", f"the build left no {m.path}")
        elif built == m.sha256:
            self.line("ok", "module", f"built {m.path}: sha256 {built}, as the profile pins")
        else:
            self.line("done", "module", f"built {m.path}: sha256 {built}; the profile pins {m.sha256[:12]}...: pin it "
                      f"with 'flatshare profiles pin-module --from-node {self.target.name}', commit, then release")

