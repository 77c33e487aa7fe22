"""A known_hosts file read as OpenSSH reads it, to verify a node's host key before we authenticate.

sshd(8) "SSH_KNOWN_HOSTS FILE FORMAT": ``[marker] hostnames keytype base64-key
[comment]``; hostnames are comma-separated patterns (``*``, ``?``, ``!negation``,
``[host]:port``) or hashed (``|1|salt|hash``, HMAC-SHA1 of the name);
``@revoked`` marks a key that must never be accepted; ``@cert-authority``
marks a CA key for host certificates. OpenSSH skips a line it cannot read
(a truncated key, an unknown type) and carries on, so a bad line for another
host never stops a connection to a good one; we do the same, keeping a note
per skipped line. ``@cert-authority`` lines are skipped with a note: paramiko
cannot verify host certificates. Never trust on first use: an unknown host is
refused with its key's SHA256 fingerprint.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TransportError


@dataclass(frozen=True)
class Entry:
    """One usable line: its patterns, key type, key bytes, line number and marker (``""`` or ``@revoked``)."""

    patterns: tuple[str, ...]
    key_type: str
    key: bytes
    line: int
    marker: str = ""


@dataclass
class KnownHosts:
    """The usable entries of a known_hosts file and a note per line skipped."""

    path: Path
    entries: list[Entry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def fingerprint(key: bytes) -> str:
    """``SHA256:...`` as ``ssh-keygen -l`` prints it (base64 of the sha256 of the key blob, no padding)."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key).digest()).decode().rstrip("=")


def _key_readable(key_type: str, blob: bytes) -> bool:
    """Whether paramiko can load this key (what OpenSSH's sshkey_read would accept, for the types we use)."""
    import paramiko

    try:
        paramiko.PKey.from_type_string(key_type, blob)
        return True
    except Exception:  # paramiko raises several types for a bad blob
        return False


def _text(path: Path) -> str | None:
    """The file's text (None when it does not exist).

    Raises:
        TransportError: it is not a regular file (a fifo or a device is refused, never waited on) or unreadable.
    """
    from ..common.files import Damaged, read_bytes

    try:  # bounded (a large fleet's file is a few MiB), never blocking on what is there
        raw = read_bytes(path, allow_symlink=True, limit=64 << 20)
    except Damaged as err:
        raise TransportError(f"known_hosts file {err}") from None
    return None if raw is None else raw.decode("utf-8", errors="replace")


def with_entry(path: Path, entry: str) -> str:
    """The known_hosts file's text (empty when it does not exist) with ``entry`` (a line) added on a line of
    its own.

    Raises:
        TransportError: the file is not a regular file, or unreadable.
    """
    text = _text(Path(path)) or ""
    return text + ("\n" if text and not text.endswith("\n") else "") + entry


def read(path: Path) -> KnownHosts:
    """Read a known_hosts file.

    Raises:
        TransportError: the file is missing or unreadable (then no host can be verified).
    """
    path = Path(path)
    text = _text(path)
    if text is None:
        raise TransportError(f"known_hosts file {path} not found; add the nodes' host keys first")
    known = KnownHosts(path)
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("\ufeff"):
            # An editor's byte-order mark: OpenSSH reads it as part of the first hostname, which then matches
            # no host; so do we, and say so (the line is otherwise easy to take for a good one).
            known.notes.append(f"{path}:{number}: starts with a byte-order mark (U+FEFF, written by some editors), "
                               "which OpenSSH reads as part of the hostname; line skipped: save the file without it")
            continue
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        marker = ""
        if fields[0].startswith("@"):
            marker, fields = fields[0], fields[1:]
            if marker == "@cert-authority":
                known.notes.append(f"{path}:{number}: @cert-authority line skipped (host certificates are not "
                                   "supported; list the host keys themselves)")
                continue
            if marker != "@revoked":
                known.notes.append(f"{path}:{number}: unknown marker {marker}; line skipped")
                continue
        if len(fields) < 3:
            known.notes.append(f"{path}:{number}: not 'hostnames keytype key'; line skipped")
            continue
        try:
            blob = base64.b64decode(fields[2], validate=True)
        except ValueError:
            known.notes.append(f"{path}:{number}: the key is not base64 (truncated?); line skipped")
            continue
        if not _key_readable(fields[1], blob):
            known.notes.append(f"{path}:{number}: cannot read the {fields[1]} key (truncated or unknown type); "
                               "line skipped")
            continue
        known.entries.append(Entry(tuple(fields[0].split(",")), fields[1], blob, number, marker))
    return known


def host_label(host: str, port: int) -> str:
    """How known_hosts names a host: ``host``, or ``[host]:port`` for another port than 22."""
    return host if port == 22 else f"[{host}]:{port}"


def _hashed_match(pattern: str, name: str) -> bool:
    try:
        _, magic, salt, digest = pattern.split("|")
        mac = hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest()
        return magic == "1" and hmac.compare_digest(mac, base64.b64decode(digest))
    except ValueError:
        return False


def _wildcard(pattern: str, name: str) -> bool:
    """OpenSSH's pattern match: ``*`` any run, ``?`` one character, everything else literal
    (``[host]:port`` brackets are literal, unlike fnmatch's)."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.fullmatch(regex, name.lower()) is not None


def matches(patterns: tuple[str, ...], name: str) -> bool:
    """Whether a host ``name`` matches a line's hostname patterns (a negated match excludes it)."""
    hit = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern[1:] if negated else pattern
        found = _hashed_match(pattern, name) if pattern.startswith("|1|") else _wildcard(pattern, name)
        if found and negated:
            return False
        hit = hit or found
    return hit


def verify(known: KnownHosts, node: str, host: str, port: int, key_type: str, key: bytes) -> None:
    """Accept the server's key only if known_hosts lists it for this host and does not revoke it.

    Raises:
        TransportError: revoked, different from the listed key, or the host is unknown (the message
            gives the key's fingerprint, the lines involved, and any lines skipped nearby).
    """
    name = host_label(host, port)
    for entry in known.entries:
        if entry.marker == "@revoked" and entry.key == key and matches(entry.patterns, name):
            raise TransportError(f"{node}: {name}'s host key {fingerprint(key)} is revoked "
                                 f"({known.path}:{entry.line}); refusing to connect")
    listed = [e for e in known.entries if not e.marker and matches(e.patterns, name)]
    if any(e.key == key and e.key_type == key_type for e in listed):
        return
    skipped = f" ({'; '.join(known.notes)})" if known.notes else ""
    if listed:
        lines = ", ".join(str(e.line) for e in listed)
        raise TransportError(
            f"{node}: {name}'s host key {fingerprint(key)} ({key_type}) does not match {known.path} line {lines}; "
            "refusing to connect. If the node was reinstalled, verify its new key out of band and update known_hosts"
            + skipped)
    raise TransportError(
        f"{node}: {name} is not in {known.path}; refusing an unknown host key {key_type} {fingerprint(key)} "
        "(check that fingerprint on the node, then add the key)" + skipped)
