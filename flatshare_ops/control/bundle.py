"""A node's release as the checkout renders it, ready to ship, with the checkout's own switcher.

``{"id", "files", "commit", "protocol", "lock_sha256", "switcher"}``: the
release (its rendered files; its id is their digest), where it came from, and
the flatshare-ops code that will switch the node (the checkout's
``flatshare_ops/``, zipped), with the header the node's entry point checks
(node/entry.py): the protocol and the sha256 of the requirements.lock whose
dependencies the switcher needs. The switcher's zip describes itself in one
member, ``flatshare_ops/switcher.json`` (its generation), which the entry point reads as
data.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import zipfile
from functools import lru_cache
from pathlib import Path

from ..common.protocol import SWITCHER_DESCRIPTION
from ..common.protocol import VERSION as PROTOCOL
from ..errors import FlatshareError
from ..node.store import release_id
from ..render import render_profile
from .git import describe
from .targets import NodeTarget

PACKAGE = Path(__file__).resolve().parents[1]


def source(root: Path) -> Path:
    """The flatshare_ops code to ship: the checkout's own, else (a checkout of profiles only) this installed one."""
    own = Path(root) / "flatshare_ops"
    return own if (own / "node" / "cli.py").is_file() else PACKAGE


#: What the node runs of the package, and so all a release ships of it (tests/test_layout.py holds that these
#: parts import nothing else): the node's side, serving-check (the program the switch's serving-check step runs:
#: node/serving_check.py), what they share, and the top-level modules they import. Not shipped: the operator's
#: side, the renderer, the profile's loading, the sandbox, the operator's command line.
SHIPPED_PARTS = ("node", "check", "common")
SHIPPED_MODULES = ("__init__.py", "errors.py", "schema_errors.py")


def shipped(package: Path, path: Path) -> bool:
    """Whether ``path`` (a file under ``package``) is part of the switcher a release ships."""
    relative = path.relative_to(package)
    if "__pycache__" in relative.parts or path.suffix in (".pyc", ".pyo"):
        return False
    if len(relative.parts) == 1:
        return relative.name in SHIPPED_MODULES
    return relative.parts[0] in SHIPPED_PARTS


def generation_of(package: Path) -> int:
    """``GENERATION`` of ``package``'s own common/protocol.py: the integer its module-level ``GENERATION = N``
    assigns, read from the file's syntax tree (nothing of it runs); 1 when it assigns none (a switcher from before
    generations).

    Raises:
        FlatshareError: the file cannot be read or parsed (one line naming it).
    """
    import ast

    if Path(package).resolve() == PACKAGE:
        from ..common.protocol import GENERATION

        return GENERATION
    path = Path(package) / "common" / "protocol.py"
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError) as err:
        raise FlatshareError(f"{path}: cannot read the switcher's generation ({err}); the checkout's flatshare_ops "
                             "is damaged: restore it from git") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["GENERATION"] \
                and isinstance(node.value, ast.Constant) and type(node.value.value) is int:
            return node.value.value
    return 1


@lru_cache(maxsize=4)
def switcher(package: Path) -> dict:
    """What the node runs of the package (:func:`shipped`), and its description (common/protocol.py
    ``SWITCHER_DESCRIPTION``: ``{"generation": N}``, which node/entry.py reads), zipped reproducibly
    (sorted names, fixed times; no bytecode): ``{"sha256", "zip_b64"}``."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        info = zipfile.ZipInfo(SWITCHER_DESCRIPTION, (2026, 1, 1, 0, 0, 0))
        info.external_attr = 0o644 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        archive.writestr(info, json.dumps({"generation": generation_of(package)}, sort_keys=True) + "\n")
        for path in sorted(package.rglob("*")):
            if path.is_file() and shipped(package, path):
                info = zipfile.ZipInfo(f"flatshare_ops/{path.relative_to(package).as_posix()}", (2026, 1, 1, 0, 0, 0))
                info.external_attr = 0o644 << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, path.read_bytes())
    data = buffer.getvalue()
    return {"sha256": hashlib.sha256(data).hexdigest(), "zip_b64": base64.b64encode(data).decode()}


def lock_sha256(root: Path) -> str | None:
    """sha256 of the checkout's requirements.lock (else of the one beside this install), or None."""
    for path in (Path(root) / "requirements.lock", PACKAGE.parent / "requirements.lock"):
        try:
            return hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            continue
    return None


def bundle(root: Path, target: NodeTarget, ship: bool = True) -> dict:
    """The release for a node, rendered from the checkout.

    Args:
        ship: carry the checkout's switcher (over SSH); a local switch runs this very code.

    Returns:
        ``{"id": the digest of the files, "files": {name: text}, "commit": git describe or None,
        "protocol", "lock_sha256", "switcher": {"sha256", "zip_b64"}}``.
    """
    files = render_profile(target.loaded).release_files()
    payload: dict[str, object] = {"id": release_id(files), "files": files, "commit": describe(root)}
    if ship:
        payload.update(protocol=PROTOCOL, lock_sha256=lock_sha256(root), switcher=switcher(source(root)))
    return payload
