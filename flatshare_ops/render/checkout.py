"""The checkout's rendered files: what `make profiles` compares and rewrites.

The committed outputs of the production profile are: ``units/*``,
``profiles/NAME.serving.json``, and the generated blocks of ``README.md``
and ``PRODUCTION.md``; the fleet's (the inventory and each node's profile) are
PRODUCTION.md's node table and ``monitoring/`` (alert rules, dashboard); each variant (another ``profiles/*.toml``) renders
beside them to ``units/VARIANT/*`` and ``profiles/VARIANT.serving.json``. Computing them is pure (reads only); writing them is
:func:`write_outputs`, one atomic replacement per changed file.

The rendered trees (``units/``, ``monitoring/``, ``profiles/*.serving.json``) hold rendered files only: a file
there that no profile renders any more (a renamed or removed variant's ``units/OLD/`` and
``OLD.serving.json``, a unit production dropped) is stale (:func:`stale_outputs`), shown as drift and
removed by :func:`remove_stale`.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from ..common import durable
from ..config.inventory import load_inventory, node_profile_path
from ..config.profile import LoadedProfile, load_profile
from ..errors import ProfileError
from . import render_profile
from .docs import node_rows, quick_start, replace_block

DEFAULT_PROFILE = Path("profiles/rtx-5060-ti-serve.toml")
FLEET = Path("profiles/fleet.toml")


def variants(root: Path) -> list[Path]:
    """The checkout's variant profiles (relative to root): every ``profiles/*.toml`` but production and the inventory."""
    return sorted(p.relative_to(root) for p in (root / "profiles").glob("*.toml")
                  if p.name not in (DEFAULT_PROFILE.name, FLEET.name))


def _read(path: Path) -> str:
    """A rendered file's committed text ("" when there is none); what is no text of ours there (a directory, a
    FIFO, bytes that are not UTF-8) reads as text no render gives, so that it is drift, and --update replaces it.
    A FIFO is never opened (it would wait for a writer)."""
    from ..common.files import Damaged, read_bytes

    try:
        data = read_bytes(path, allow_symlink=True)
    except (Damaged, OSError) as err:
        return f"(not a file render would write: {getattr(err, 'form', None) or err})\n"
    try:
        return "" if data is None else data.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"(not UTF-8 text at byte {err.start})\n"


def _document(root: Path, name: str) -> str:
    """A document holding generated blocks; it must exist (its hand-written text is not ours to make).

    Raises:
        ProfileError: it is missing, is not a regular file (never waited on), or is not UTF-8 text.
    """
    from ..common.files import Damaged, read_bytes

    restore = f"restore it (git checkout {name}) before rendering"
    try:
        data = read_bytes(root / name, allow_symlink=True)
    except (Damaged, OSError) as err:
        raise ProfileError(f"{name}: {getattr(err, 'form', None) or err}; {restore}") from None
    if data is None:
        raise ProfileError(f"{name}: not found in {root}; {restore}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ProfileError(f"{name}: not UTF-8 text (byte {err.start}); {restore}") from None


def expected_outputs(root: Path, profile_path: Path | None = None) -> dict[Path, str]:
    """Every committed file the profile renders, with its expected full text.

    Args:
        root: the checkout's top directory.
        profile_path: the profile (default ``profiles/rtx-5060-ti-serve.toml``), relative to root.

    Returns:
        Path relative to ``root`` -> expected text.

    Raises:
        ProfileError: the profile, the inventory or a document's markers are wrong.
    """
    profile_path = profile_path or DEFAULT_PROFILE
    loaded = load_profile(root / profile_path)
    rendered = render_profile(loaded)
    outputs: dict[Path, str] = {Path("units") / name: text for name, text in rendered.units.items()}
    outputs[profile_path.with_name(f"{loaded.profile.name}.serving.json")] = rendered.serving

    readme = _document(root, "README.md")
    outputs[Path("README.md")] = replace_block(readme, "quick-start", quick_start(loaded, rendered.argv), "README.md")

    inventory = load_inventory(root / FLEET)
    by_node: dict[str, LoadedProfile] = {
        name: load_profile(node_profile_path(root / FLEET, node)) for name, node in inventory.nodes.items()
    }
    production = _document(root, "PRODUCTION.md")
    outputs[Path("PRODUCTION.md")] = replace_block(production, "nodes", node_rows(by_node), "PRODUCTION.md")
    outputs.update(monitoring_outputs(inventory, by_node))
    if profile_path == DEFAULT_PROFILE:
        owner = {path: profile_path for path in outputs}
        for variant in variants(root):
            mine = variant_outputs(root, variant)
            for path in mine:
                clash = next(((p, o) for p, o in owner.items() if p == path or path in p.parents
                              or p in path.parents), None)
                if clash:
                    raise ProfileError(
                        f"{variant}: name: its rendered file {path} collides with {clash[0]} of {clash[1]}; "
                        "give the variant a name of its own (not another profile's, not a unit's file name)")
                owner[path] = variant
            outputs.update(mine)
    return outputs


def monitoring_outputs(inventory, by_node: dict[str, LoadedProfile]) -> dict[Path, str]:
    """The fleet's Prometheus rules and Grafana dashboard (``monitoring/``), from the inventory and each
    node's profile: the fleet's, like PRODUCTION.md's node table, so a variant a node runs is in them."""
    from .alert_rules import RULES_FILE, render_rules
    from .dashboard import DASHBOARD_FILE, render_dashboard

    return {Path(RULES_FILE): render_rules(inventory, by_node), Path(DASHBOARD_FILE): render_dashboard(by_node)}


PLACEHOLDER_PIN = "0" * 64


def placeholder_pins(root: Path) -> list[str]:
    """One line per profile of the checkout (production and variants) that pins the placeholder module hash."""
    found = []
    for path in [DEFAULT_PROFILE, *variants(root)]:
        try:
            pin = load_profile(root / path).profile.module.sha256
        except ProfileError:
            continue
        if pin == PLACEHOLDER_PIN:
            found.append(f"{path} pins a placeholder module hash (zeros): a release of it to a production node (a sandbox "
                         "builds and pins its own) is refused until you "
                         f"pin the built module: 'flatshare profiles pin-module --sha256 HEX --profile {path}' "
                         "(or --file PATH, or --from-node NAME)")
    return found


def variant_outputs(root: Path, variant: Path) -> dict[Path, str]:
    """A variant's rendered files, beside production's: ``units/NAME/*`` and ``profiles/NAME.serving.json``.

    Raises:
        ProfileError: the variant does not load or render.
    """
    loaded = load_profile(root / variant)
    rendered = render_profile(loaded)
    name = loaded.profile.name
    outputs = {Path("units") / name / unit: text for unit, text in rendered.units.items()}
    outputs[variant.with_name(f"{name}.serving.json")] = rendered.serving
    return outputs


def drift(root: Path, outputs: dict[Path, str], stale: bool = True) -> dict[Path, str]:
    """Unified diffs of the files whose committed text differs from ``outputs``, and of the stale ones.

    Args:
        stale: also name the :func:`stale_outputs` (``outputs`` must then be the whole checkout's).

    Returns:
        Path -> diff text (``--- a/PATH`` committed, ``+++ b/PATH`` rendered, or ``+++ /dev/null`` for a
        stale file); empty when none drifted.
    """
    diffs = stale_diffs(root, stale_outputs(root, outputs)) if stale else {}
    for path, text in outputs.items():
        current = _read(root / path)
        if current != text:
            diffs[path] = "".join(
                difflib.unified_diff(
                    current.splitlines(keepends=True),
                    text.splitlines(keepends=True),
                    fromfile=f"a/{path}",
                    tofile=f"b/{path}",
                )
            )
    return diffs


def misplaced(root: Path, paths) -> list[str]:
    """For each of ``paths`` (relative to root) where something other than a file is (a directory, a FIFO...),
    what is there and what to do, one phrase each: :func:`write_outputs` cannot replace it."""
    import os
    import stat

    from ..common.files import what_is

    found = []
    for path in paths:
        try:
            mode = os.lstat(root / path).st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            found.append(f"{path}: {what_is(mode)} where a rendered file belongs; remove it (or restore it: "
                         f"git checkout {path}) first")
    return found


#: Directories (relative to the checkout) that hold rendered files only, and the profiles' rendered files.
RENDERED_TREES = (Path("units"), Path("monitoring"))
RENDERED_GLOBS = ("profiles/*.serving.json",)


def stale_outputs(root: Path, outputs: dict[Path, str]) -> list[Path]:
    """Files (relative to root) in the rendered trees that are not in ``outputs`` (the whole checkout's
    :func:`expected_outputs`): left by a renamed or removed variant, or a file a profile no longer renders."""
    found = set()
    for tree in RENDERED_TREES:
        found |= {p.relative_to(root) for p in (root / tree).rglob("*") if p.is_file() or p.is_symlink()}
    for pattern in RENDERED_GLOBS:
        found |= {p.relative_to(root) for p in root.glob(pattern)}
    return sorted(found - set(outputs))


def stale_diffs(root: Path, stale: list[Path]) -> dict[Path, str]:
    """A unified diff per stale file: its whole text removed (``+++ /dev/null``), as ``git diff`` shows a deletion."""
    diffs = {}
    for path in stale:
        lines = _read_lossy(root / path).splitlines(keepends=True)
        body = "".join(difflib.unified_diff(lines, [], fromfile=f"a/{path}", tofile="/dev/null"))
        diffs[path] = body or f"--- a/{path}\n+++ /dev/null\n"
    return diffs


def _read_lossy(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return ""


def remove_stale(root: Path, outputs: dict[Path, str]) -> list[Path]:
    """Remove the :func:`stale_outputs` (and the directories they leave empty); returns the paths removed."""
    stale = stale_outputs(root, outputs)
    for path in stale:
        durable.remove(root / path)
    for path in stale:
        parent = (root / path).parent
        while parent != root and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent
    return stale


def write_outputs(root: Path, outputs: dict[Path, str]) -> list[Path]:
    """Write the changed outputs, all or none; return the paths written (relative to root).

    Each changed file's new text is first written whole beside it (a temporary file, fsynced); only when every
    one is written are they renamed into place, one ``rename(2)`` each, which needs no room. A full disk, a
    directory that cannot be written, or something other than a file where an output belongs (a directory, a
    FIFO: never opened) then changes no output.

    Raises:
        WriteFailed: an output could not be written (the file and why, in one line); no output changed.
    """
    import os
    import tempfile

    from ..errors import WriteFailed

    changed = [(path, text) for path, text in outputs.items()
               if not ((root / path).exists() and _read(root / path) == text)]
    wrong = misplaced(root, [path for path, _ in changed])
    if wrong:
        raise WriteFailed(f"{'; '.join(wrong)}, and render again; no rendered file was changed")
    staged: list[tuple[Path, str]] = []
    try:
        for path, text in changed:
            target = root / path
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
                staged.append((Path(name), str(path)))
                with os.fdopen(fd, "wb") as f:
                    f.write(text.encode())
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(name, 0o644)
            except OSError as err:
                raise WriteFailed(f"{path}: cannot be written ({err.strerror or err}); no rendered file was "
                                     "changed") from None
        for (temporary, _), (path, _) in zip(staged, changed):
            os.replace(temporary, root / path)
        for parent in {(root / path).parent for path, _ in changed}:
            durable.fsync_dir(parent)
    except BaseException:
        for temporary, _ in staged:
            temporary.unlink(missing_ok=True)
        raise
    return [path for path, _ in changed]
