"""Every drop-in systemd reads for a unit, found where systemd looks for them (standard library only).

systemd.unit(5), docs/reference/systemd.md#drop-in-directories: for unit
``foo-bar.service`` systemd reads ``*.conf`` from ``foo-bar.service.d/``,
from each prefix directory made by cutting the name after a dash
(``foo-.service.d/``), and from the type-wide ``service.d/``, in every
directory of the manager's unit search path (its ``UnitPath``); all of them
apply, in file-name order. flatshare-ops renders no drop-ins, so each one
found is foreign: an E2 benchmark point (a symlink into the benchmark tree)
or someone's local change.
"""

from __future__ import annotations

from pathlib import Path


def drop_in_dirs(unit: str) -> list[str]:
    """The drop-in directory names systemd reads for ``unit``: its own, the dash prefixes, the type's."""
    stem, dot, kind = unit.rpartition(".")
    if not dot:
        return [f"{unit}.d"]
    names = [f"{unit}.d"]
    cut = stem
    while "-" in cut:
        cut = cut[: cut.rindex("-")]
        names.append(f"{cut}-.{kind}.d")
    names.append(f"{kind}.d")
    return names


def on_disk(unit: str, search_path: list[str]) -> list[Path]:
    """Every ``*.conf`` drop-in for ``unit`` in the search path's directories, links included
    (also ones linked since the last daemon-reload, which systemd does not list yet)."""
    found: list[Path] = []
    for base in search_path:
        for name in drop_in_dirs(unit):
            directory = Path(base) / name
            try:
                entries = sorted(directory.iterdir())
            except OSError:
                continue
            found += [p for p in entries if p.name.endswith(".conf")]
    return found


def describe(path: Path) -> str:
    """``DIR/NAME.conf -> TARGET`` for a symlink, ``DIR/NAME.conf`` for a file."""
    label = f"{path.parent.name}/{path.name}"
    try:
        return f"{label} -> {path.readlink()}" if path.is_symlink() else label
    except OSError:
        return label
