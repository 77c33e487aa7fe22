"""Preflight: before a node is drained for an engine restart, can the new engine start at all?

A drain costs calls, and an engine that cannot start keeps the node drained
for its whole start budget (900 s in production) before the release fails.
So, before anything is drained, on the node itself:

- the model path exists (when it is a path), and the speculative draft model's;
- the serve module's build command exists and is executable;
- in the node's own engine venv, as the engine's user (serving.json's ``engine.user``: the unit's ``User=``,
  when the switch runs as root; its home is made first if missing, as systemd's ``StateDirectory=`` makes
  it at the engine's start), with the engine's own environment (serving.json's
  ``engine.environment``: the unit's ``Environment=``, ``PYTHONPATH`` included, and no ``VLLM_*`` or
  ``HF_*`` variable of the switch's own; ``HF_HUB_OFFLINE=1``, a node fetches nothing), what
  ``vllm serve`` runs before it touches the device:
  ``ENGINE_VENV/bin/python flatshare_ops/common/vllm_serve_parse.py preflight``: vLLM's own parser
  (which builds vLLM's config defaults, so a venv whose platform cannot be inferred is refused here),
  vLLM's cache directory (``VLLM_CACHE_ROOT`` as vLLM resolves it: made and written as that user),
  ``AsyncEngineArgs.from_cli_args(args).create_engine_config()`` (the model's config.json: a
  ``--max-model-len`` above its positions, a draft model that is not there), vLLM's renderer (the
  tokenizer's files, which the API server reads before the engine core starts) and the import of
  ``--scheduler-cls`` as the engine core imports it. Any refusal refuses the release with vLLM's
  own message. What needs the device is not checked, and the plan says so (:data:`NOT_CHECKED`).

Importing vLLM costs about 5-7 s of CPU per process, so it runs only here (and in the tests),
once per release that restarts the engine; the plan line gives its time.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from ..common.files import loads

class _Credentials(TypedDict, total=False):
    """subprocess.Popen's arguments that run a child as the engine's user."""

    user: int
    group: int
    extra_groups: list[int]
    cwd: str


#: How long the parse (or the preflight) may take (seconds): importing vLLM is most of it.
PARSE_TIMEOUT_S = 180.0
#: What the preflight cannot check without the device (named in the plan).
NOT_CHECKED = ("loading the weights", "the attention backend and kernels on the device",
               "memory for the weights and the KV cache", "the serve module the start builds (the one "
               "built now is imported)")
#: vLLM's stages (vllm_serve_parse.py preflight) as the plan names them.
STAGES = {"parser": "vLLM's parser", "cache": "vLLM's cache directory", "parse": "the command line",
          "validate": "vLLM's post-parse checks", "config": "the engine's configuration", "model": "the model's files",
          "tokenizer": "the tokenizer", "scheduler": "the scheduler class"}
#: Tells the parse script not to check vLLM's cache directory (a dry run whose engine home is made at start).
SKIP_CACHE_VARIABLE = "FLATSHARE_PREFLIGHT_SKIP_CACHE"
#: The parse script (a module of the switcher, which runs from a zip: node/entry.py), run by the engine venv's
#: interpreter from a copy in a scratch directory of its own.
PARSE_SCRIPT = ("flatshare_ops.common", "vllm_serve_parse.py")


def parse_with_venv(venv: Path, words: list[str], timeout_s: float = PARSE_TIMEOUT_S, progress=None,
                    mode: str = "parse", env: dict[str, str] | None = None, user: str | None = None) -> dict:
    """Parse ``vllm serve WORDS`` with the vLLM installed in ``venv`` (or run its preflight).

    Args:
        venv: the engine venv (its ``bin/python`` runs the parse script).
        words: the words after ``serve``, model first.
        timeout_s: the parse's bound, in seconds.
        progress: called with the seconds waited, at :func:`common.poll.progress_every` (vLLM's import
            takes several).
        mode: ``parse`` or ``preflight`` (vllm_serve_parse.py's modes).
        env: the script's environment (default: this process's, with ``VLLM_LOGGING_LEVEL=ERROR``).
        user: run the script as this user, with its primary group and no other (as systemd runs a unit's
            ``User=``); None runs it as this process's user.

    Returns:
        The script's result: ``{"ok": True, "namespace": {...}}`` or ``{"ok": False, "error": MESSAGE}``;
        ``{"ok": False, "error": ..., "preflight": True}`` when the parse itself could not run
        (no interpreter, timeout, no JSON): the message says which, naming the bound.
    """
    python = Path(venv) / "bin" / "python"
    if not os.access(python, os.X_OK):
        return {"ok": False, "preflight": True, "error": f"{python} is not an executable interpreter"}
    import tempfile

    from ..common.poll import poll_until

    env = env if env is not None else {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    credentials: _Credentials = {}
    if user is not None:
        import pwd

        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            return {"ok": False, "preflight": True, "error": f"the engine's user {user} does not exist on this node "
                    "(flatshare node bootstrap makes it)"}
        credentials = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": [], "cwd": "/"}
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr, \
            tempfile.TemporaryDirectory(prefix="flatshare-preflight-") as scratch:
        import pkgutil

        script = Path(scratch) / PARSE_SCRIPT[1]
        script.write_bytes(pkgutil.get_data(*PARSE_SCRIPT) or b"")
        if credentials:  # the scratch directory is root's alone (0700): the engine's user gets it
            os.chown(scratch, credentials["user"], credentials["group"])
        try:
            process = subprocess.Popen([str(python), str(script), mode], stdin=subprocess.PIPE,
                                       stdout=stdout, stderr=stderr, text=True, env=env, **credentials)
        except OSError as err:
            as_user = f" as {user}" if user else ""
            return {"ok": False, "preflight": True, "error": f"cannot run {python}{as_user}: {err.strerror or err}"}
        assert process.stdin is not None  # stdin=PIPE
        try:
            process.stdin.write(json.dumps(words))
            process.stdin.close()
            if poll_until(lambda: process.poll() is not None, timeout_s, 0.02, progress) is None:
                return {"ok": False, "preflight": True, "error": f"vLLM's parser did not answer within {timeout_s:g} s"}
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()
        stdout.seek(0)
        stderr.seek(0)
        output, errors = stdout.read(), stderr.read()
    try:
        answer = loads(output)  # bounded, RFC 8259 numbers (common/files.py)
        if not isinstance(answer, dict) or "ok" not in answer:
            raise ValueError("not a parse result")
        return answer
    except ValueError:
        tail = (errors.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "preflight": True, "error": f"the parse script exited {process.returncode}: {tail}"}


def engine_environment(serving: dict) -> dict[str, str]:
    """The environment the preflight runs vLLM in: the engine's own, as its unit sets it.

    This process's environment without ``PYTHONPATH`` and any ``VLLM_*`` or ``HF_*`` variable (vLLM reads
    those; the engine started by systemd never sees the switch's), then serving.json's
    ``engine.environment`` (the unit's ``Environment=``; an older release without it: ``PYTHONPATH`` as
    the module's directory), then ``HF_HUB_OFFLINE=1`` (a node fetches no model: a missing local path
    is refused at once rather than after the hub's retries) and ``VLLM_LOGGING_LEVEL=ERROR``.
    """
    engine = serving.get("engine", {})
    own = engine.get("environment")
    if not isinstance(own, dict):
        module = (serving.get("module") or {}).get("path")
        own = {"PYTHONPATH": os.path.dirname(module)} if isinstance(module, str) else {}
    kept = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("VLLM_", "HF_"))}
    return {**kept, **{str(k): str(v) for k, v in own.items()}, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}


def engine_user(serving: dict) -> str | None:
    """The user the preflight runs vLLM as: the engine unit's ``User=`` (serving.json ``engine.user``) when
    this process may become it (it runs as root) and it is another user; None runs it as this process."""
    user = serving.get("engine", {}).get("user")
    if not isinstance(user, str) or not user or user == "root" or os.geteuid() != 0:
        return None
    return user


def make_engine_home(serving: dict, user: str) -> str | None:
    """Make the engine's ``HOME`` (serving.json's ``engine.environment``) when it is missing, owned by ``user``
    with mode 0755: what systemd's ``StateDirectory=`` makes at the engine's start (systemd.exec(5)), made
    now so that the preflight can run as the engine will. Returns why it could not, or None.
    """
    import pwd

    home = (serving.get("engine", {}).get("environment") or {}).get("HOME")
    if not isinstance(home, str) or not home.startswith("/") or os.path.lexists(home):
        return None
    try:  # the parents as systemd makes them (root's, 0755), the home itself the user's
        entry = pwd.getpwnam(user)
        os.makedirs(os.path.dirname(home), mode=0o755, exist_ok=True)
        os.mkdir(home, 0o755)
        os.chown(home, entry.pw_uid, entry.pw_gid)
    except (KeyError, OSError) as err:
        return f"cannot make the engine's home {home} for {user}: {getattr(err, 'strerror', None) or err}"
    return None


@dataclass
class Outcome:
    """What the preflight found.

    Attributes:
        problems: why the engine cannot start, one line each (empty: it may).
        seconds: the preflight's own time (wall clock).
        checked: what vLLM checked, as the plan names it (:data:`STAGES`).
        not_checked: what needs the device and was not checked (:data:`NOT_CHECKED`).
        notes: what the preflight did or left out beyond its checks, one line each, for the plan.
    """

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    checked: list[str] = field(default_factory=list)
    not_checked: tuple[str, ...] = NOT_CHECKED

    def summary(self) -> str:
        """``checked: ...; not checked: ...`` for the plan line."""
        return f"checked: {', '.join(self.checked) or 'nothing'}; not checked: {', '.join(self.not_checked)}"


def problems(serving: dict, progress=None) -> list[str]:
    """Why the release's engine cannot start on this node (empty when it can), one line each."""
    return run(serving, progress).problems


def run(serving: dict, progress=None, dry_run: bool = False) -> Outcome:
    """The whole preflight (module docstring): the paths, then vLLM in the engine venv.

    Args:
        serving: the new release's serving.json.
        progress: called with the seconds waited while vLLM works.
        dry_run: make nothing: an engine home that is missing is not made, and vLLM's cache directory is then
            not checked (said in ``notes``).

    Returns:
        An :class:`Outcome`; it never raises for what it finds.
    """
    from ..common.vllm_release import same_release

    started = time.monotonic()
    outcome = Outcome()
    engine = serving.get("engine", {})
    argv = list(engine.get("argv", []))
    venv = Path(engine.get("venv", "/nonexistent"))
    release = str(serving.get("vllm_release", "the profile's release"))
    found = outcome.problems
    if "serve" not in argv[:3]:
        found.append(f"the engine's command line is not 'vllm serve MODEL ...': {argv[:3]}")
        return outcome
    words = argv[argv.index("serve") + 1 :]
    model = words[0] if words else ""
    if model.startswith("/") and not Path(model).exists():
        found.append(f"the model path {model} does not exist on this node")
    odd = odd_files(Path(model), "the model's") if model.startswith("/") else []
    if "--speculative-config" in words:
        try:
            draft = json.loads(words[words.index("--speculative-config") + 1]).get("model", "")
        except (ValueError, IndexError, AttributeError):
            draft = ""
        if isinstance(draft, str) and draft.startswith("/") and not Path(draft).exists():
            found.append(f"the speculative draft model path {draft} does not exist on this node")
        elif isinstance(draft, str) and draft.startswith("/"):
            odd += odd_files(Path(draft), "the speculative draft model's")
    if odd:  # vLLM's reader would wait on a FIFO among the model's files: nothing more is asked of it
        found += odd
        outcome.seconds = time.monotonic() - started
        return outcome
    build = (serving.get("module") or {}).get("build_command") or []
    if build and not (Path(build[0]).is_file() and os.access(build[0], os.X_OK)):
        found.append(f"the serve module's build command {build[0]} is missing or not executable")
    user = engine_user(serving)
    env = engine_environment(serving)
    home = env.get("HOME", "")
    if home.startswith("/") and os.path.islink(home) and not os.path.exists(home):
        found.append(f"the engine's home {home} is a symbolic link to {os.readlink(home)}, which does not exist: "
                     f"remove the link (rm {home}; systemd's StateDirectory= makes the directory at the engine's "
                     "start)")
    elif user is not None and home.startswith("/") and not os.path.lexists(home):
        if dry_run:
            env[SKIP_CACHE_VARIABLE] = "1"
            outcome.notes.append(f"the engine's home {home} does not exist yet (made before the engine starts): "
                                 "vLLM's cache directory not checked in a dry run")
        else:
            made = make_engine_home(serving, user)
            if made:
                found.append(made)
            else:
                outcome.notes.append(f"made the engine's home {home} for {user}")
    answer = parse_with_venv(venv, words, progress=progress, mode="preflight", env=env, user=user)
    outcome.checked = [STAGES.get(stage, stage) for stage in answer.get("checked", []) if stage in STAGES]
    if not answer.get("ok"):
        stage = answer.get("stage")
        if answer.get("preflight"):
            found.append(f"vLLM in {venv} could not be asked about the engine: {answer['error']}")
        elif stage == "parser":
            hint = ""
            if "infer device type" in str(answer.get("error")):
                hint = (" (vLLM's platform detection found no device in this venv: its vLLM's version names none "
                        "and the engine's environment sets no VLLM_TARGET_DEVICE)")
            found.append(f"vLLM {release} in {venv} cannot start with the engine's environment: "
                         f"{answer['error']}{hint}")
        elif stage in ("parse", "validate"):
            found.append(f"vLLM {release} in {venv} rejects the engine's command line: {answer['error']}")
        elif stage == "config":
            found.append(f"vLLM {release} in {venv} refuses the engine's configuration: {answer['error']}")
        elif stage == "model":
            found.append(f"the engine's user ({user or 'this user'}) cannot read the model: {answer['error']}")
        elif stage == "cache":
            found.append(f"vLLM {release} in {venv} cannot keep its caches as the engine's user "
                         f"({user or 'this user'}): {answer['error']} (flatshare node bootstrap gives the engine's "
                         "home to the service user)")
        elif stage == "tokenizer":
            found.append(f"vLLM {release} in {venv} cannot load the tokenizer: {answer['error']}")
        elif stage == "scheduler":
            found.append(f"vLLM {release} in {venv} cannot import the scheduler class "
                         f"({engine.get('environment', {}).get('PYTHONPATH', 'no PYTHONPATH')} on PYTHONPATH): "
                         f"{answer['error']}")
        else:
            found.append(f"vLLM {release} in {venv}: {answer.get('error')}")
    running = answer.get("release")
    if isinstance(running, str) and not same_release(running, release):
        found.append(f"vLLM in {venv} says it is {running} (importlib.metadata), the release needs {release}")
    outcome.seconds = time.monotonic() - started
    return outcome


#: How long a passed preflight may be reused by a switch to the same release (seconds): a rollout's fleet
#: preflight, then its switches, within the hour.
KEPT_S = 3600.0
#: Where passed preflights are kept, under the node's releases directory: ``RELEASE_ID.json`` each.
KEPT_DIR = ".preflight"


#: What a model's files are named (Hugging Face's layout): never a directory.
_MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".py", ".jinja", ".tiktoken")


def odd_files(directory: Path, whose: str) -> list[str]:
    """One line for each file directly in a model's ``directory`` (a symlink followed) that is neither a
    regular file nor a directory, or a directory named as a model's files are (``config.json``,
    ``*.safetensors``...): a FIFO there stops vLLM's reader (and this preflight's) until a writer comes, and a
    socket or a device is no model file; a dangling link is named too. [] when the directory cannot be listed
    (vLLM's own checks say why)."""
    import stat

    from ..common.files import what_is

    found = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in sorted(entries, key=lambda e: e.name):
        try:
            mode = os.stat(entry.path).st_mode
        except FileNotFoundError:
            found.append(f"{whose} file {entry.path} is a dangling symlink: restore the file it names, or remove it")
            continue
        except OSError:
            continue  # unreadable: the engine's user's read of the model (its own check) says so
        if not (stat.S_ISREG(mode) or (stat.S_ISDIR(mode) and not entry.name.endswith(_MODEL_FILE_SUFFIXES))):
            found.append(f"{whose} file {entry.path} is {what_is(mode)}, not a regular file: put the model's file "
                         "back")
    return found


def fingerprint(release: str, serving: dict) -> str:
    """What a preflight checked, as one digest: the release (its id covers the engine's command line,
    environment and user), the engine venv's installed distributions (their ``*.dist-info`` names: each a name
    and version), the model's ``config.json`` (its bytes' sha256, when the model is a local directory) and the
    user the preflight ran as. Any change makes another digest, and the preflight runs again."""
    import hashlib

    engine = serving.get("engine", {})
    venv = Path(str(engine.get("venv", "/nonexistent")))
    dists = sorted(p.name for p in venv.glob("lib/python*/site-packages/*.dist-info"))
    argv = list(engine.get("argv", []))
    model = argv[argv.index("serve") + 1] if "serve" in argv[:3] and argv.index("serve") + 1 < len(argv) else ""
    from ..common.files import Damaged, read_bytes

    try:  # a FIFO, a socket or a device there is never opened (it would wait for a writer)
        data = read_bytes(Path(model) / "config.json", allow_symlink=True) if model.startswith("/") else b""
        config = hashlib.sha256(data).hexdigest() if data is not None else "missing"
    except (Damaged, OSError):
        config = "unreadable"
    document = {"release": release, "dists": dists, "config": config, "user": engine_user(serving),
                "euid": os.geteuid()}
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def kept(releases: Path, release: str, serving: dict) -> dict | None:
    """The passed preflight kept for ``release`` (:func:`keep`) when nothing it checked changed since and it is
    younger than :data:`KEPT_S`: ``{"at": Unix seconds, "summary": what it checked}``; else None (none kept, a
    damaged file, another digest: the preflight runs again)."""
    from ..common.files import Damaged, read_json_object

    try:
        document = read_json_object(Path(releases) / KEPT_DIR / f"{release}.json")
    except (Damaged, OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("fingerprint") != fingerprint(release, serving):
        return None
    at, summary = document.get("at"), document.get("summary")
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not 0 <= time.time() - at <= KEPT_S \
            or not isinstance(summary, str):
        return None
    return {"at": float(at), "summary": summary}


def keep(releases: Path, release: str, serving: dict, outcome: Outcome) -> None:
    """Keep a passed preflight of ``release`` for a later switch to reuse. A cache, not one of the switch's
    durable records: written whole (a temporary file renamed over it) without fsync (one lost in a crash is
    run again), and a failed write is no failure of the preflight (the switch then runs its own)."""
    import tempfile

    directory = Path(releases) / KEPT_DIR
    document = {"release": release, "fingerprint": fingerprint(release, serving), "at": time.time(),
                "summary": outcome.summary(), "seconds": round(outcome.seconds, 3)}
    try:
        directory.mkdir(mode=0o755, exist_ok=True)
        for old in directory.glob("*.json"):  # one kept preflight a release, none older than they may be used
            try:
                if time.time() - old.stat().st_mtime > KEPT_S:
                    old.unlink()
            except OSError:
                pass
        with tempfile.NamedTemporaryFile("w", dir=directory, prefix=f".{release}.", delete=False) as scratch:
            scratch.write(json.dumps(document, sort_keys=True) + "\n")
        os.chmod(scratch.name, 0o644)
        os.replace(scratch.name, directory / f"{release}.json")
    except OSError:
        try:
            os.unlink(scratch.name)
        except (OSError, NameError):
            pass
