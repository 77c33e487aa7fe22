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
2. unpacks the switcher into ``releases/.switchers/SHA256/`` (the zip checked
   against its sha256 and kept there; an unpacked tree is used only when it is
   exactly the zip, else unpacked again: :func:`_tree_matches`), and
3. runs it with this venv's interpreter and dependencies.

Commands without a bundle (status, history, probe, rollback...) run the
switcher of the node's active release (a rollback runs the switcher of the
release it leaves), checked against its kept zip the same way, or the installed
code when there is none, it cannot be checked, or it is older than
:data:`OLDEST_GENERATION` (said on stderr). Standard
library only, and kept small: its protocol is the contract between every
checkout and every node.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import io
import json
import os
import shutil
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
#: Runs the switcher: argv[1] is the switcher directory ("" for the installed code). A switcher runs without
#: bytecode (none written, and a tree holding any is unpacked again: _tree_matches), so that what runs is
#: exactly the source checked against the zip.
BOOT = ("import sys; d = sys.argv[1]; sys.argv = ['flatshare-node'] + sys.argv[2:]; "
        "sys.dont_write_bytecode = sys.dont_write_bytecode or bool(d); "
        "d and sys.path.insert(0, d); from flatshare_ops.node.cli import main; main()")
#: The most the bundle's line on stdin may hold (bytes).
MAX_BUNDLE_BYTES = 256 << 20
REFUSED = 3
BAD_INPUT = 2


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


#: The switcher's zip, kept in its directory: the truth the unpacked tree is checked against (its sha256 is
#: the directory's name).
KEPT_ZIP = "switcher.zip"
#: The most a shipped switcher may hold, zipped (bytes; flatshare_ops/ is well under 1 MiB).
MAX_ZIP_BYTES = 64 << 20


def unpack(releases: Path, switcher: dict) -> Path:
    """Unpack a shipped switcher into ``releases/.switchers/SHA256/``; returns that directory.

    A directory already there is used only when its tree is exactly the zip (:func:`_tree_matches`);
    otherwise (truncated, edited, a file added) it is unpacked again.

    Raises:
        ValueError: the zip does not match its sha256, or is not a zip of ``flatshare_ops/``.
        TooOld: the switcher is older than this entry point runs (nothing is unpacked).
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
        return _put_in_place(releases / ".switchers" / digest, data, archive)


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


def _check_members(archive: zipfile.ZipFile) -> None:
    unpacked = sum(info.file_size for info in archive.infolist())
    if unpacked > MAX_UNPACKED_BYTES:
        raise ValueError(f"the shipped switcher holds {unpacked} bytes unpacked, more than {MAX_UNPACKED_BYTES >> 20} MiB")
    for info in archive.infolist():
        name = info.filename
        if not name.startswith("flatshare_ops/") or ".." in Path(name).parts or name.startswith("/"):
            raise ValueError(f"the shipped switcher holds {name!r}, outside flatshare_ops/")
        if (info.external_attr >> 16) & 0o170000 not in (0, 0o100000, 0o040000):
            raise ValueError(f"the shipped switcher holds {name!r}, which is not a file or a directory")


def _put_in_place(target: Path, data: bytes, archive: zipfile.ZipFile) -> Path:
    """``target`` holding exactly ``archive`` (and its zip, :data:`KEPT_ZIP`): used as it is when it already
    does, else unpacked afresh beside it and renamed into place (a damaged copy moved aside first)."""
    from flatshare_ops.common.files import remove_tree

    if _tree_matches(target, archive) and _kept_zip(target) == data:
        _touch(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name[:12]}.", dir=target.parent))
    try:
        archive.extractall(scratch)
        (scratch / KEPT_ZIP).write_bytes(data)
        for attempt in range(3):
            try:
                os.rename(scratch, target)
                return target
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
            if _tree_matches(target, archive) and _kept_zip(target) == data:
                return target  # another command on this node put it right meanwhile
            aside = target.with_name(f".damaged-{target.name[:12]}-{os.getpid()}-{attempt}")
            try:
                os.rename(target, aside)
            except FileNotFoundError:
                continue
            if aside.is_dir() and not aside.is_symlink():
                remove_tree(aside)
            else:
                aside.unlink(missing_ok=True)
        raise OSError(errno.EEXIST, "another process keeps replacing it", str(target))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _kept_zip(target: Path) -> bytes | None:
    """The zip kept in ``target`` when it is the one ``target`` is named after (its sha256), else None."""
    from flatshare_ops.common.files import Damaged, read_bytes

    try:
        data = read_bytes(target / KEPT_ZIP, limit=MAX_ZIP_BYTES)
    except Damaged:
        return None
    return data if data is not None and hashlib.sha256(data).hexdigest() == target.name else None


def _tree_matches(target: Path, archive: zipfile.ZipFile) -> bool:
    """Whether the unpacked tree at ``target`` is exactly the archive: every member a regular file of its
    size and sha256 (the archive's member hashed here: the zip itself is checked against its digest, so a
    file changed on purpose to keep its CRC-32 is caught too; read without blocking, links never followed),
    and nothing else but empty directories and the kept zip (a ``__pycache__`` file counts as something
    else: switchers run without bytecode)."""
    import stat

    from flatshare_ops.common.files import open_regular

    expected = {i.filename: (i.file_size, hashlib.sha256(archive.read(i)).digest())
                for i in archive.infolist() if not i.is_dir()}
    deepest = max((len(Path(name).parts) for name in expected), default=1)
    found = 0
    try:
        if not stat.S_ISDIR(os.lstat(target).st_mode):
            return False  # a link (its tree lies elsewhere), a file, anything but the directory itself
        for top, dirs, names in os.walk(target):
            if len(Path(os.path.relpath(top, target)).parts) >= deepest:
                if dirs:
                    return False  # deeper than any member: not the zip's (and os.walk recurses: never far)
            for name in dirs:
                if not stat.S_ISDIR(os.lstat(os.path.join(top, name)).st_mode):
                    return False  # a link where a directory belongs
            for name in names:
                path = os.path.join(top, name)
                relative = os.path.relpath(path, target)
                if relative == KEPT_ZIP:
                    continue
                if relative not in expected:
                    return False
                size, digest = expected[relative]
                fd = open_regular(Path(path))
                try:
                    if os.fstat(fd).st_size != size:
                        return False
                    value = hashlib.sha256()
                    while block := os.read(fd, 1 << 20):
                        value.update(block)
                finally:
                    os.close(fd)
                if value.digest() != digest:
                    return False
                found += 1
    except OSError:
        return False
    return found == len(expected)


def _touch(directory: Path) -> None:
    """Mark a switcher as in use now: a prune never removes one used in the last hour."""
    try:
        os.utime(directory)
    except OSError:
        pass


def active_switcher(releases: Path) -> Path | None:
    """The switcher the active release was switched with (``releases/current/switcher``), checked against
    its kept zip and unpacked again from it when it does not match; None (the installed code runs) when
    there is none, or it cannot be checked (said on stderr)."""
    from flatshare_ops.common.files import Damaged, read_bytes

    try:
        digest = (read_bytes(releases / "current" / "switcher", limit=4096) or b"").decode("ascii").strip()
    except (Damaged, UnicodeDecodeError):
        return None
    directory = releases / ".switchers" / digest
    if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest) or not os.path.lexists(directory):
        return None
    data = _kept_zip(directory)
    if data is None:
        print(f"flatshare-node: note: the active release's switcher {directory} cannot be checked (its "
              f"{KEPT_ZIP} is missing or damaged): running the installed flatshare-ops instead; the next "
              "release unpacks its switcher again", file=sys.stderr, flush=True)
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            _check_members(archive)
            generation = switcher_generation(archive)
            if generation < OLDEST_GENERATION:
                print(f"flatshare-node: note: the active release's switcher {directory} is generation {generation}, "
                      f"older than this node runs ({OLDEST_GENERATION}): running the installed flatshare-ops "
                      "instead", file=sys.stderr, flush=True)
                return None
            return _put_in_place(directory, data, archive)
    except (ValueError, OSError, zipfile.BadZipFile) as err:
        print(f"flatshare-node: note: the active release's switcher {directory} could not be unpacked again "
              f"({err}): running the installed flatshare-ops instead", file=sys.stderr, flush=True)
        return None


def _run(switcher: Path | None, argv: list[str]) -> NoReturn:
    env = dict(os.environ)
    if switcher is not None:
        env["FLATSHARE_SWITCHER"] = switcher.name
    os.execve(sys.executable, [sys.executable, "-c", BOOT, str(switcher or ""), *argv], env)


def main() -> None:
    """Console-script entry point (``flatshare-node COMMAND --node ... --state-dir ...``)."""
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
            switcher = unpack(releases, bundle["switcher"])
        except TooOld as err:
            _refuse(f"release refused: the release's switcher is generation {err.generation}, older than this node "
                    f"runs ({OLDEST_GENERATION}: an older switcher's admission to drain is known to let the last "
                    "serving node drain); release from a current checkout")
        except (ValueError, KeyError, TypeError, zipfile.BadZipFile) as err:
            _refuse(f"node switch: the shipped switcher is damaged ({err})", BAD_INPUT)
        except OSError as err:
            _refuse(f"release refused: cannot unpack the switcher into {releases} ({err.strerror or err})")
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
        os.set_inheritable(read_fd, True)
        return ["--bundle-file", f"/dev/fd/{read_fd}"]
    incoming = releases / ".incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="bundle.", suffix=".json", dir=incoming)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return ["--bundle-file", path]


if __name__ == "__main__":
    main()
