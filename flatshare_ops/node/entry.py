"""``flatshare-node``: the small, stable entry point a node keeps; the switcher itself comes with each release.

A node must never switch with older or newer code than the release was
reviewed with. So the operator's side ships the checkout's flatshare-ops
inside the release bundle (the switcher), and this entry point, installed
once by ``flatshare node bootstrap``, only:

1. reads the bundle's header: ``protocol`` (what this entry point can run:
   :data:`PROTOCOL`) and ``lock_sha256`` (the sha256 of the checkout's
   requirements.lock, which must be the lock this node's venv was installed
   from); anything it cannot run is refused in one line, exit 3, and so is a
   switcher older than :data:`OLDEST_GENERATION` (common/protocol.py
   ``GENERATION``: an older one's rules are known to break a promise);
2. keeps the switcher in ``releases/.switchers/SHA256/``: the zip as shipped
   (checked against its sha256) and the zip that runs, made from it once by
   this node's interpreter with each module's bytecode beside its source and
   checked against its own sha256 at every use (:func:`keep`); and
3. runs it in its own process, with this venv's interpreter and dependencies.

Commands without a bundle (status, history, probe, rollback...) run the
switcher of the node's active release (a rollback runs the switcher of the
release it leaves), checked the same way and made again from its kept zip when
damaged, or the installed code when there is none, it cannot be checked, or it
is older than :data:`OLDEST_GENERATION` (said on stderr). Standard
library only, and kept small: its protocol is the contract between every
checkout and every node.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from flatshare_ops.common import protocol

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing into every node command
if TYPE_CHECKING:
    from typing import NoReturn

#: The bundle protocol this entry point runs (common/protocol.py: raise it only for a change an older
#: entry point cannot run).
PROTOCOL = protocol.VERSION
#: The oldest switcher generation this entry point runs (common/protocol.py ``GENERATION``): its own.
OLDEST_GENERATION = protocol.GENERATION
#: Where a switcher's zip says its generation, as data; the most it may hold (bytes), and the highest generation.
DESCRIPTION = protocol.SWITCHER_DESCRIPTION
MAX_DESCRIPTION_BYTES = 4096
MAX_GENERATION = 1_000_000
#: The most the bundle's line on stdin may hold (bytes).
MAX_BUNDLE_BYTES = 256 << 20
REFUSED = 3
BAD_INPUT = 2
OUTPUT_CLOSED = 141  # errors.Exit's codes, without importing it into every node command


def installed_lock_sha256() -> str | None:
    """sha256 of the requirements.lock this venv was installed from (kept beside the venv), or None."""
    from flatshare_ops.common.files import Damaged, read_bytes

    path = Path(sys.prefix).parent / "requirements.lock"
    try:  # bounded, never blocking on what is there
        data = read_bytes(path, allow_symlink=True, limit=16 << 20)
    except Damaged:
        return None
    return hashlib.sha256(data).hexdigest() if data is not None else None


def _option(argv: list[str], name: str) -> str | None:
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def _first_line() -> bytes:
    """stdin's first line (the bundle), read in large chunks.

    The operator's side sends nothing after it until the switch asks for admission, so
    nothing read past the newline can be an answer; bytes there break the protocol and
    are refused (they could not be handed to the switcher, which reads stdin after this
    process is replaced).
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_BUNDLE_BYTES:
            _refuse(f"node switch: the bundle's line is longer than {MAX_BUNDLE_BYTES >> 20} MiB; make it with "
                    "'flatshare release'", BAD_INPUT)
        end = chunk.find(b"\n")
        if end < 0:
            chunks.append(chunk)
            continue
        if end + 1 < len(chunk):
            _refuse("node switch: input came after the bundle's line before the switch asked for any", BAD_INPUT)
        chunks.append(chunk)
        return b"".join(chunks)


def _refuse(message: str, code: int = REFUSED) -> NoReturn:
    print(f"flatshare-node: {message}", flush=True)
    switch = _option(sys.argv[1:], "--switch-id") or ""
    result = protocol.OutcomeResult.REFUSED if code == REFUSED else protocol.OutcomeResult.FAILED
    print(protocol.line(protocol.Outcome(switch, code, result, None, message)), end="", flush=True)
    sys.exit(code)


#: The switcher's zip as shipped, kept in its directory (its sha256 is the directory's name): the truth the
#: zip that runs is made from.
KEPT_ZIP = "switcher.zip"
#: What runs, on ``sys.path`` (Python's zipimport): the kept zip's members and, beside each module, its bytecode
#: compiled by this node's interpreter (an unchecked hash-based pyc: the whole zip is checked instead). Named by its
#: own sha256 (``run-SHA256.zip``) and never replaced: zipimport reads a module from the offsets it read at the
#: first import, so a process running from a zip must find that zip unchanged until it ends.
RUN_ZIP = "run-{sha256}.zip"
#: ``{"sha256": of the zip that runs, "magic": the interpreter's bytecode magic, "generation"}``, written after it.
RUN_NOTE = "run.json"
#: How long a zip that runs, no longer the one :data:`RUN_NOTE` names, is kept for a process that may still run
#: from it (seconds: a day, as long as a release may wait).
RUN_ZIP_KEPT_S = 86400
#: The most a shipped switcher may hold, zipped (bytes; flatshare_ops/ is well under 1 MiB).
MAX_ZIP_BYTES = 64 << 20


def keep(releases: Path, switcher: dict) -> Path:
    """Keep a shipped switcher in ``releases/.switchers/SHA256/``; returns the zip that runs it (:data:`RUN_ZIP`).

    A directory already there is used when its zips are the shipped one and one made from it by this interpreter
    (:func:`_in_place`); what is damaged in it is made again.

    Raises:
        ValueError: the zip does not match its sha256, or is not a zip of ``flatshare_ops/``.
        TooOld: the switcher is older than this entry point runs (nothing is kept).
        OSError: the switcher could not be written.
    """
    data = base64.b64decode(switcher["zip_b64"], validate=True)
    digest = hashlib.sha256(data).hexdigest()
    if digest != switcher.get("sha256"):
        raise ValueError(f"the shipped switcher's sha256 is {digest}, not {switcher.get('sha256')}")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        _check_members(archive)
        generation = switcher_generation(archive)
        if generation < OLDEST_GENERATION:
            raise TooOld(generation)
        return _in_place(releases / ".switchers" / digest, data, archive, generation)


class TooOld(Exception):
    """A switcher older than this entry point runs (:data:`OLDEST_GENERATION`); ``generation``: its own."""

    def __init__(self, generation: int) -> None:
        super().__init__(generation)
        self.generation = generation


def switcher_generation(archive: zipfile.ZipFile) -> int:
    """The generation a switcher's zip says it is, as data (its :data:`DESCRIPTION` member); 1 when it has none
    (every switcher before generations were written down).

    Raises:
        ValueError: the description is not JSON or holds no integer generation.
    """
    from flatshare_ops.common.files import loads

    try:
        info = archive.getinfo(DESCRIPTION)
    except KeyError:
        return 1
    if info.file_size > MAX_DESCRIPTION_BYTES:
        raise ValueError(f"its {DESCRIPTION} holds {info.file_size} bytes, more than a description's "
                         f"{MAX_DESCRIPTION_BYTES}")
    try:  # bounded: no NaN, no huge integer, no nesting past common/files.py's limit
        document = loads(archive.read(info))
    except ValueError as err:
        raise ValueError(f"its {DESCRIPTION} is not JSON ({err})") from None
    generation = document.get("generation") if isinstance(document, dict) else None
    if not isinstance(generation, int) or isinstance(generation, bool) or not 1 <= generation <= MAX_GENERATION:
        raise ValueError(f"its {DESCRIPTION} holds no generation from 1 to {MAX_GENERATION}")
    return generation


#: The most a switcher may hold unpacked (bytes; flatshare_ops/ is a few MiB).
MAX_UNPACKED_BYTES = 64 << 20


#: What a switcher must hold to run at all: its package and the node's command line.
REQUIRED_MEMBERS = ("flatshare_ops/__init__.py", "flatshare_ops/node/__init__.py", "flatshare_ops/node/cli.py")


def _check_members(archive: zipfile.ZipFile) -> None:
    unpacked = sum(info.file_size for info in archive.infolist())
    if unpacked > MAX_UNPACKED_BYTES:
        raise ValueError(f"the shipped switcher holds {unpacked} bytes unpacked, more than {MAX_UNPACKED_BYTES >> 20} MiB")
    names: set[str] = set()
    for info in archive.infolist():
        name = info.filename
        if name in names:
            raise ValueError(f"the shipped switcher holds {name!r} twice")
        names.add(name)
        if not name.startswith("flatshare_ops/") or ".." in Path(name).parts or name.startswith("/"):
            raise ValueError(f"the shipped switcher holds {name!r}, outside flatshare_ops/")
        if (info.external_attr >> 16) & 0o170000 not in (0, 0o100000, 0o040000):
            raise ValueError(f"the shipped switcher holds {name!r}, which is not a file or a directory")
        if name.endswith((".pyc", ".pyo")):
            raise ValueError(f"the shipped switcher holds {name!r}, bytecode (a switcher ships its source; the node "
                             "compiles it)")
    missing = [name for name in REQUIRED_MEMBERS if name not in names]
    if missing:
        raise ValueError(f"the shipped switcher holds no {missing[0]!r}")


def _in_place(directory: Path, data: bytes, archive: zipfile.ZipFile, generation: int) -> Path:
    """:func:`_in_place_locked`, one command at a time (:class:`_making`)."""
    with _making(directory.parent):
        return _in_place_locked(directory, data, archive, generation)


#: How long a command waits for another one making a kept switcher's files (seconds); past it, it makes them too.
MAKING_WAIT_S = 60.0


class _making:
    """Holds ``.switchers/.making`` (an flock) while one command makes a kept switcher's files: two at once
    moved each other's fresh directory aside. Bounded: past :data:`MAKING_WAIT_S` it goes on without it."""

    def __init__(self, switchers: Path) -> None:
        self.switchers, self.fd = switchers, -1

    def __enter__(self) -> None:
        import fcntl
        import time

        self.switchers.mkdir(parents=True, exist_ok=True)
        try:
            self.fd = os.open(self.switchers / ".making", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                              | os.O_CLOEXEC, 0o600)
        except OSError:
            return  # something else in its place: made without it, as before there was one
        deadline = time.monotonic() + MAKING_WAIT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)

    def __exit__(self, *_exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the lock goes with it


def _in_place_locked(directory: Path, data: bytes, archive: zipfile.ZipFile, generation: int) -> Path:
    """``directory`` holding the shipped zip (:data:`KEPT_ZIP`, exactly ``data``) and the zip that runs it
    (:data:`RUN_ZIP`, as :data:`RUN_NOTE` names it); each made again when it is not so, and anything but a
    directory at ``directory`` (a link, a file) moved aside and removed first. Returns the zip that runs. Each file
    is written whole beside its place and renamed into it."""
    import stat

    try:
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            aside = directory.with_name(f".damaged-{directory.name[:12]}-{os.getpid()}")
            os.rename(directory, aside)
            aside.unlink()
    except FileNotFoundError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    if _kept_zip(directory) != data:
        _write(directory / KEPT_ZIP, data)
    run = _run_zip(directory)
    if run is None:
        _remove_leftovers(directory)
        made = _compiled(archive, directory)
        digest = hashlib.sha256(made).hexdigest()
        run = directory / RUN_ZIP.format(sha256=digest)
        if not _whole(run, digest):  # one whole already is never written again: a command may run from it
            _write(run, made)
        note = {"sha256": digest, "magic": _magic(), "generation": generation}
        _write(directory / RUN_NOTE, json.dumps(note, sort_keys=True).encode() + b"\n")
    _touch(directory)
    return run


def _magic() -> str:
    """This interpreter's bytecode magic number, in hex (what a pyc made for it starts with)."""
    from importlib.util import MAGIC_NUMBER

    return MAGIC_NUMBER.hex()


def _compiled(archive: zipfile.ZipFile, directory: Path) -> bytes:
    """A zip of ``archive``'s files and, beside each module ``M.py``, ``M.pyc``: its bytecode as this interpreter
    compiles it, an unchecked hash-based pyc (PEP 552: magic, flags 0b01, the source's hash, the marshalled code),
    named ``DIRECTORY/M.py`` in tracebacks.

    Raises:
        ValueError: a member cannot be read (an unknown compression, corrupt data), or a module does not compile.
    """
    import marshal
    import zlib
    from importlib.util import MAGIC_NUMBER, source_hash

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as out:
        for info in archive.infolist():
            if info.is_dir():
                continue
            try:
                source = archive.read(info)
            except (zipfile.BadZipFile, NotImplementedError, RuntimeError, EOFError, zlib.error) as err:
                raise ValueError(f"its {info.filename} cannot be read ({err})") from None
            out.writestr(_member(info.filename), source)
            if info.filename.endswith(".py"):
                try:
                    code = compile(source, f"{directory}/{info.filename}", "exec", dont_inherit=True)
                except (SyntaxError, ValueError, MemoryError, RecursionError) as err:
                    raise ValueError(f"its {info.filename} does not compile ({type(err).__name__}: "
                                     f"{str(err)[:200]})") from None
                pyc = MAGIC_NUMBER + (0b01).to_bytes(4, "little") + source_hash(source) + marshal.dumps(code)
                out.writestr(_member(info.filename + "c"), pyc)
    return buffer.getvalue()


#: How old a file being written beside its place (:func:`_write`) must be to be a leftover of a process that died
#: while writing it (seconds; a switcher's zips are written in well under one).
LEFTOVER_S = 600


def _remove_leftovers(directory: Path) -> None:
    """Remove the files a killed process left half-written in ``directory`` (:func:`_write`'s, past
    :data:`LEFTOVER_S`; never one being written now), and zips that ran, past :data:`RUN_ZIP_KEPT_S`."""
    import time

    for pattern, age in ((f".{KEPT_ZIP}.*", LEFTOVER_S), (".run-*.zip.*", LEFTOVER_S), (f".{RUN_NOTE}.*", LEFTOVER_S),
                         ("run-*.zip", RUN_ZIP_KEPT_S)):
        for leftover in directory.glob(pattern):
            try:
                if time.time() - leftover.lstat().st_mtime > age:
                    leftover.unlink()
            except OSError:
                continue


def _member(name: str) -> zipfile.ZipInfo:
    """A member of the zip that runs, with a fixed time: the same switcher, compiled by the same interpreter in the
    same directory, makes the same zip (so the same name, :data:`RUN_ZIP`), whenever it is made."""
    info = zipfile.ZipInfo(name, (2026, 1, 1, 0, 0, 0))
    info.external_attr = 0o644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def _write(path: Path, data: bytes) -> None:
    """``path`` replaced whole by ``data`` (written beside it, then renamed: never seen half-written); a directory
    there is moved aside and removed first."""
    import stat

    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            from flatshare_ops.common.files import remove_tree

            aside = path.with_name(f".damaged-{path.name}-{os.getpid()}")
            os.rename(path, aside)
            remove_tree(aside)
    except FileNotFoundError:
        pass
    fd, scratch = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.rename(scratch, path)
    except BaseException:
        try:
            os.unlink(scratch)
        except OSError:
            pass
        raise


def _matching(path: Path, digest: str, limit: int) -> bytes | None:
    """The bytes of the file ``path`` when their sha256 is ``digest``, else None (read bounded, without blocking,
    a link never followed)."""
    from flatshare_ops.common.files import Damaged, read_bytes

    try:
        data = read_bytes(path, limit=limit)
    except Damaged:
        return None
    return data if data is not None and hashlib.sha256(data).hexdigest() == digest else None


def _kept_zip(directory: Path) -> bytes | None:
    """The zip kept in ``directory`` when it is the one ``directory`` is named after (its sha256), else None."""
    return _matching(directory / KEPT_ZIP, directory.name, MAX_ZIP_BYTES)


def _run_zip(directory: Path) -> Path | None:
    """The zip that runs the switcher in ``directory`` when it is whole (its sha256 the one :data:`RUN_NOTE`
    holds), made by this interpreter (its magic) and of a generation this entry point runs; else None.
    Read without blocking, links never followed."""
    from flatshare_ops.common.files import Damaged, loads, read_bytes

    try:
        note = loads(read_bytes(directory / RUN_NOTE, limit=4096) or b"null")
    except (Damaged, ValueError):
        return None
    if not isinstance(note, dict) or note.get("magic") != _magic():
        return None
    digest, generation = note.get("sha256"), note.get("generation")
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < OLDEST_GENERATION:
        return None
    if not isinstance(digest, str) or len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        return None
    run = directory / RUN_ZIP.format(sha256=digest)
    return run if _whole(run, digest) else None


def _whole(run: Path, digest: str) -> bool:
    """Whether the zip that runs at ``run`` holds bytes whose sha256 is ``digest``."""
    return _matching(run, digest, MAX_UNPACKED_BYTES * 2) is not None


def _touch(directory: Path) -> None:
    """Mark a switcher as in use now: a prune never removes one used in the last hour."""
    try:
        os.utime(directory)
    except OSError:
        pass


def _installed(why: str) -> Path | None:
    """None (the installed code runs), said on stderr with ``why``."""
    print(f"flatshare-node: note: the active release's {why}: running the installed flatshare-ops instead; the "
          "next release keeps its switcher again", file=sys.stderr, flush=True)
    return None


def active_switcher(releases: Path) -> Path | None:
    """The zip that runs the switcher the active release was switched with (``releases/current/switcher``
    names it): its :data:`RUN_ZIP` when whole, else made again from its kept zip; None (the installed code
    runs) when there is none, or it cannot be checked (said on stderr)."""
    from flatshare_ops.common.files import Damaged, read_bytes

    note = releases / "current" / "switcher"
    try:
        text = read_bytes(note, limit=4096)
    except Damaged as err:
        return _installed(f"{note} cannot be read ({err.form})")
    if text is None:  # a release switched by the installed code (a local switch) names no switcher
        return None
    try:
        digest = text.decode("ascii").strip()
    except UnicodeDecodeError:
        digest = ""
    directory = releases / ".switchers" / digest
    if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        return _installed(f"{note} does not hold a switcher's sha256")
    if os.path.isdir(directory) and not os.path.islink(directory) and (run := _run_zip(directory)) is not None:
        _touch(directory)
        return run
    try:
        with _making(directory.parent):  # another command may be making it right now: after it, or alone
            if os.path.isdir(directory) and not os.path.islink(directory) and (run := _run_zip(directory)):
                _touch(directory)
                return run
            if not os.path.lexists(directory):
                return _installed(f"switcher {directory} is not kept on this node")
            data = _kept_zip(directory)  # through a link too: what it holds is checked, and the link replaced
            if data is None:
                return _installed(f"switcher {directory} cannot be checked (its {KEPT_ZIP} is missing or damaged)")
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                _check_members(archive)
                generation = switcher_generation(archive)
                if generation < OLDEST_GENERATION:
                    return _installed(f"switcher {directory} is generation {generation}, older than this node runs "
                                      f"({OLDEST_GENERATION})")
                return _in_place_locked(directory, data, archive, generation)
    except (ValueError, OSError, zipfile.BadZipFile) as err:
        return _installed(f"switcher {directory} could not be made ready to run again ({err})")


def _run(switcher: Path | None, argv: list[str]) -> NoReturn:
    """Run the command line ``argv`` in this process, with the switcher's zip (node/cli.py ``main``), or with the
    installed code when ``switcher`` is None.

    The zip goes first on ``sys.path`` and every ``flatshare_ops`` module this entry point imported from the
    installed code is forgotten, so that each module the command uses comes from the zip (one interpreter: a
    command pays for one start, and the standard library's modules are imported once).
    """
    _use(switcher)
    sys.argv = ["flatshare-node", *argv]
    from flatshare_ops.node.cli import main as command

    command()
    sys.exit(0)


def _use(switcher: Path | None) -> None:
    """Make the switcher's zip the ``flatshare_ops`` this process imports from now on (nothing when None)."""
    if switcher is None:
        return
    os.environ["FLATSHARE_SWITCHER"] = switcher.parent.name  # the switcher's sha256 (its directory's name)
    for name in [m for m in sys.modules if m == "flatshare_ops" or m.startswith("flatshare_ops.")]:
        del sys.modules[name]
    sys.path.insert(0, str(switcher))


def main() -> None:
    """Console-script entry point (``flatshare-node COMMAND --node ... --state-dir ...``). A closed standard
    stream is opened on /dev/null first; an answer that could not be written to stdout (its reader gone, a full
    disk) ends the command with exit 141, in silence when its reader went away (common/streams.py)."""
    from flatshare_ops.common.streams import OutputError, output_lost, prepare

    prepare()
    try:
        try:
            _main()
        finally:  # here, not at the interpreter's exit: a failed flush is then one of the output's errors
            sys.stdout.flush()
    except OutputError as lost:
        output_lost(lost, "flatshare-node")
        sys.exit(OUTPUT_CLOSED)


def _main() -> None:
    argv = sys.argv[1:]
    if argv[:1] in (["--version"], ["-V"]):
        from flatshare_ops import version

        print(f"flatshare-node {version()} (bundle protocol {PROTOCOL}, oldest switcher generation {OLDEST_GENERATION})")
        sys.exit(0)
    state_dir = _option(argv, "--state-dir")
    releases = Path(state_dir) / "releases" if state_dir else None
    if not argv or argv[0] != "switch" or releases is None or _option(argv, "--rollback") is not None \
            or "--rollback" in argv or _option(argv, "--undo-rollout") is not None:
        _run(active_switcher(releases) if releases is not None else None, argv)
    from flatshare_ops.common.files import loads

    line = _first_line()
    try:
        bundle = loads(line) if line.strip() else {}
    except ValueError as err:  # not JSON, nested too deeply, NaN or an infinity
        _refuse(f'node switch: stdin is not JSON ({err}); expected a release bundle {{"id", "files"}}', BAD_INPUT)
    if not isinstance(bundle, dict):
        _refuse('node switch: the release bundle must be {"id": ..., "files": {...}}', BAD_INPUT)
    speaks = bundle.get("protocol", 1)
    if not isinstance(speaks, int) or isinstance(speaks, bool):
        _refuse(f"node switch: the bundle's protocol must be an integer, got {speaks!r}", BAD_INPUT)
    if speaks > PROTOCOL:
        _refuse(f"release refused: the release's switcher speaks protocol {speaks}, this node's entry point "
                f"runs protocol {PROTOCOL} at most; update the node: 'flatshare node bootstrap --node NAME' "
                "from that checkout")
    switcher = None
    if "switcher" in bundle:
        lock = installed_lock_sha256()
        if bundle.get("lock_sha256") != lock:
            _refuse(f"release refused: the release's switcher needs the dependencies of a requirements.lock with "
                    f"sha256 {bundle.get('lock_sha256')}, this node's venv was installed from {lock or 'no lock'}; "
                    "install them: 'flatshare node bootstrap --node NAME' from that checkout")
        try:
            releases.mkdir(parents=True, exist_ok=True)
            switcher = keep(releases, bundle["switcher"])
        except TooOld as err:
            _refuse(f"release refused: the release's switcher is generation {err.generation}, older than this node "
                    f"runs ({OLDEST_GENERATION}: an older switcher's admission to drain is known to let the last "
                    "serving node drain); release from a current checkout")
        except (ValueError, KeyError, TypeError, zipfile.BadZipFile) as err:
            _refuse(f"node switch: the shipped switcher is damaged ({err})", BAD_INPUT)
        except OSError as err:
            where = f"{err.filename}: " if err.filename else ""
            _refuse(f"release refused: cannot keep the switcher in {releases} ({where}{err.strerror or err}); "
                    "free the space or move what is in the way aside, then release again")
        bundle = {k: v for k, v in bundle.items() if k != "switcher"}
    try:
        handed = _hand_over(releases, json.dumps(bundle).encode())
    except OSError as err:
        _refuse(f"release refused: cannot hand the bundle over in {releases} ({err.strerror or err})")
    _run(switcher, [*argv, *handed])


def _hand_over(releases: Path, data: bytes) -> list[str]:
    """Pass the bundle (its switcher stripped) to the switcher: through a pipe when it fits the pipe's
    buffer (nothing written to disk), else through a file in ``releases/.incoming/``."""
    if len(data) < 60000:
        read_fd, write_fd = os.pipe()
        os.write(write_fd, data)
        os.close(write_fd)
        return ["--bundle-file", f"/dev/fd/{read_fd}"]
    incoming = releases / ".incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="bundle.", suffix=".json", dir=incoming)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return ["--bundle-file", path]


if __name__ == "__main__":
    main()
