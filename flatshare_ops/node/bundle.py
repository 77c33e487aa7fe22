"""A release as the node receives it (the bundle) and as it keeps it (``releases/<id>/``), both checked by its id.

A release is named by what it renders: its id is the digest of its files
(``serving.json``, ``profile.json``, ``units/NAME``: :func:`.store.release_id`).
So the node trusts neither a bundle from stdin nor a stored copy for what it
claims to be: both are read whole and checked against their id before any of
it is used (releases/README.md). A stored release whose files no longer make
its id is damage, named, with nothing done.
"""

from __future__ import annotations

import hashlib

from ..common import serving_shape
from ..common.files import Damaged, json_damage, loads, read_bytes
from ..common.release_files import MAX_FILE_BYTES, RELEASE_FILE, read_release
from ..errors import FlatshareError, NodeStateError
from .context import NodeContext
from .plan import ReleaseView
from .store import RELEASE_ID, is_stored, release_id


def validate_bundle(bundle: object) -> dict:
    """Check a release bundle read from stdin before any of it touches the disk.

    Raises:
        FlatshareError (exit 2): not ``{"id": ID, "files": {NAME: TEXT}}``, an id
            that is not a plain directory name, a file name outside
            ``serving.json``, ``profile.json``, ``units/UNIT``, a serving.json of
            the wrong shape, units that are not the ones it names, or an id that is
            not the digest of the files.
    """
    if not isinstance(bundle, dict) or not isinstance(bundle.get("id"), str) or not isinstance(bundle.get("files"), dict):
        raise FlatshareError('node switch: the release bundle must be {"id": ..., "files": {...}}')
    if not RELEASE_ID.match(bundle["id"]):
        raise FlatshareError(f"node switch: release id {bundle['id']!r} is not a plain name ([A-Za-z0-9._-])")
    for name, text in bundle["files"].items():
        if not isinstance(name, str) or not RELEASE_FILE.match(name) or not isinstance(text, str):
            raise FlatshareError(f"node switch: release file {name!r} is not serving.json, profile.json or units/UNIT")
    if bundle.get("commit") is not None and not isinstance(bundle["commit"], str):
        raise FlatshareError("node switch: the bundle's commit must be a string")
    wrong = _consistency(bundle["files"])
    if wrong:
        raise FlatshareError(f"node switch: the bundle {wrong}")
    digest = release_id(bundle["files"])
    if bundle["id"] != digest:
        # A release is named by what it renders (releases/README.md): a stored release of that
        # name must never be replaced by other files.
        raise FlatshareError(f"node switch: the bundle's id {bundle['id']} is not the digest of its files "
                             f"({digest}); make the bundle with 'flatshare release'")
    return bundle


def _consistency(files: dict[str, str]) -> str | None:
    """What is wrong inside a release's files (serving.json's shape, its units' sha256s), or None:
    ``has no serving.json``, ``has a serving.json that ...``, ``lacks units/NAME``..."""
    if "serving.json" not in files:
        return "has no serving.json"
    try:
        serving = loads(files["serving.json"])
    except ValueError as err:
        return f"has a serving.json that is {json_damage(err)}"
    wrong = serving_shape.problem(serving) if isinstance(serving, dict) else "not an object"
    if wrong:
        return f"has a serving.json that is not a release's serving.json ({wrong})"
    for name, digest in serving["units"].items():
        text = files.get(f"units/{name}")
        if text is None:
            return f"lacks units/{name}, which its serving.json names"
        if hashlib.sha256(text.encode()).hexdigest() != digest:
            return f"has a units/{name} that is not the file serving.json names (sha256)"
    return None


def bundle_view(bundle: dict) -> ReleaseView:
    """The release a (validated) bundle carries, as the planner sees it."""
    files = bundle["files"]
    units = {name.removeprefix("units/"): text for name, text in files.items() if name.startswith("units/")}
    return ReleaseView(bundle["id"], units, loads(files["serving.json"]))


def stored_files(ctx: NodeContext, rid: str) -> dict[str, str]:
    """Every release file of stored release ``rid``, read whole and checked against its id.

    Raises:
        NodeStateError: the release is not stored, or its directory holds a file that is
            missing, unreadable, not UTF-8, of another name, or that does not make the id
            (truncated or edited): named, with what to do.
    """
    directory = ctx.releases / rid
    if not is_stored(ctx.state_dir, rid):
        raise NodeStateError(f"{directory}: release {rid} is not stored on {ctx.node}; "
                             "release it again from a checkout that renders it ('flatshare release')")
    advice = (f"release {rid} is damaged on {ctx.node}; remove its directory (rm -r {directory}) and "
              "release it again ('flatshare release')")
    try:
        files = read_release(directory, rid)
    except Damaged as err:
        wrong = None
        if err.path == directory and "its files make" in err.form:
            wrong = _consistency(_readable(directory))
        raise NodeStateError(f"{err}" + (f" ({wrong})" if wrong else "") + f": {advice}") from None
    wrong = _consistency(files)
    if wrong:  # files that make their id but are no release (a release made that way was never stored by us)
        raise NodeStateError(f"{directory}: release {rid} {wrong}: {advice}")
    return files


def _readable(directory) -> dict[str, str]:
    """What can be read of a damaged release directory's files (bounded, never blocking), to say what is
    wrong inside it."""
    files = {}
    for path in sorted(directory.rglob("*")):
        name = path.relative_to(directory).as_posix()
        if RELEASE_FILE.match(name):
            try:
                files[name] = (read_bytes(path, limit=MAX_FILE_BYTES) or b"").decode("utf-8", errors="replace")
            except Damaged:
                files[name] = ""
    return files if "serving.json" in files else {"serving.json": ""}


def load_view(ctx: NodeContext, rid: str) -> ReleaseView:
    """A stored release as the planner sees it, verified by its id first (:func:`stored_files`).

    Raises:
        NodeStateError: the release is missing or damaged (names the file and the damage).
    """
    files = stored_files(ctx, rid)
    return bundle_view({"id": rid, "files": files})


def stored_matches(ctx: NodeContext, bundle: dict) -> bool:
    """Whether the stored release of the bundle's id holds exactly the bundle's files (not damaged since)."""
    try:
        return stored_files(ctx, bundle["id"]) == bundle["files"]
    except NodeStateError:
        return False
