"""Where the running engine's Python imports the serve module from (standard library only).

serving-check's module check hashes the file the profile pins; the engine imports whatever its own
``sys.path`` finds first. Python's order (the ``sys.path`` documentation, "The initialization of the
sys.path module search path"): the running script's directory (``vllm`` is a console script in the venv's
``bin/``), then ``PYTHONPATH``'s entries, then the interpreter's own directories. A module of the same name in
the venv's ``bin/``, or on a drop-in's ``PYTHONPATH``, is the one the engine runs, whatever the pinned file
holds. So the entries that come before the pinned file's directory are
searched with the standard library's own finder (``importlib.machinery.PathFinder``), in the engine
process's own argv and environment (``/proc``).
"""

from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path

from ..common.proc import read_cmdline, read_environ


def search_path(argv: list[str], environ: dict[str, str], cwd: str) -> list[str]:
    """The first entries of the process's ``sys.path``: the script's directory (for ``python SCRIPT``; the
    working directory for ``-m``/``-c``; none with ``-P``, ``-I`` or ``PYTHONSAFEPATH``), then ``PYTHONPATH``'s
    entries (relative ones against ``cwd``; ignored with ``-E`` or ``-I``). The interpreter's own directories
    come after these and are not listed."""
    if not argv or not os.path.basename(argv[0]).startswith("python"):
        return []  # not a Python interpreter's command line (a shebang script's argv[0] is its interpreter)
    options, script, words = [], None, iter(argv[1:])
    for word in words:
        if word in ("-m", "-c"):
            script = ""
            break
        if not word.startswith("-"):
            script = word
            break
        options.append(word)
        if word in ("-X", "-W", "--check-hash-based-pycs"):
            next(words, None)  # the option's argument
    flags = "".join(o[1:] for o in options if not o.startswith("--"))
    entries = []
    if script is not None and not ({"P", "I"} & set(flags)) and not environ.get("PYTHONSAFEPATH"):
        entries.append(os.path.dirname(os.path.join(cwd, script)) if script else cwd)
    if not ({"E", "I"} & set(flags)):
        entries += [os.path.join(cwd, e) for e in environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    return entries


def imported_from(pid: int, pinned: Path) -> tuple[str | None, list[str]]:
    """Where process ``pid`` imports the module ``pinned`` names (its stem), if from somewhere else.

    Returns:
        (the other file, or None when the pinned file comes first or the process could not be read; the
        entries searched before the pinned file's directory). When the pinned directory is in none of the
        entries, every entry is searched, and the other file is the first found there, else None.
    """
    try:
        argv, environ = read_cmdline(pid), read_environ(pid)
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None, []
    entries = search_path(argv, environ, cwd)
    home = os.path.realpath(pinned.parent)
    before = []
    for entry in entries:
        if os.path.realpath(entry) == home:
            break
        before.append(entry)
    spec = importlib.machinery.PathFinder.find_spec(pinned.stem, before) if before else None
    origin = getattr(spec, "origin", None) if spec is not None else None
    if origin and os.path.realpath(origin) != os.path.realpath(pinned):
        return origin, before
    return None, before
