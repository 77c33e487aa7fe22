"""A plain HTTP/1.0 GET with one overall deadline (standard library only).

A socket rather than urllib: urllib and http.client import the email package
(about 25 ms), a third of a serving-check's cost (adr/0006-serving-check-cost.md);
the engine's endpoints (docs/reference/vllm.md, "API server endpoints") need
nothing beyond a status line and a body.
"""

from __future__ import annotations

import socket
import time

#: The default bound of one request, connect to last byte (seconds).
HTTP_TIMEOUT_S = 2.0
#: The most of a body read (bytes): /metrics of a busy engine is well under this.
MAX_BODY = 8 << 20
#: :func:`http_fetch`'s phrase for a connection refused (``ECONNREFUSED``): nothing listens at the address.
REFUSED = "did not answer (connection refused: nothing listens there)"


def http_get(url: str, timeout_s: float = HTTP_TIMEOUT_S) -> tuple[int, bytes]:
    """GET ``http://HOST:PORT/PATH``; the whole exchange is bounded by ``timeout_s`` seconds.

    Returns:
        (status, body); status 0 when nothing answered in time or the answer
        was not HTTP (a slow-drip server cannot stretch the bound: each read
        gets only what is left of it). :func:`http_fetch` also says which.
    """
    status, body, _why = http_fetch(url, timeout_s)
    return status, body


def http_fetch(url: str, timeout_s: float = HTTP_TIMEOUT_S) -> tuple[int, bytes, str]:
    """:func:`http_get`, with what went wrong when the status is 0: ``(status, body, why)``, ``why`` a phrase
    ("did not answer within 5 s", :data:`REFUSED`, "answered more than 8 MiB", "answered something that is
    not HTTP", "could not be reached (...)"), empty with a status."""
    rest = url.removeprefix("http://")
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    late = f"did not answer within {timeout_s:g} s"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            conn.sendall(f"GET /{path} HTTP/1.0\r\nHost: {hostport}\r\nConnection: close\r\n\r\n".encode())
            received = 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return 0, b"", late
                conn.settimeout(left)
                chunk = conn.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                received += len(chunk)
                if received > MAX_BODY:
                    return 0, b"", f"answered more than {MAX_BODY >> 20} MiB"
    except TimeoutError:
        return 0, b"", late
    except ConnectionRefusedError:
        return 0, b"", REFUSED
    except (OSError, ValueError) as err:
        return 0, b"", f"could not be reached ({type(err).__name__}: {err})"
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), body, ""
    except (IndexError, ValueError):
        return 0, b"", "answered something that is not HTTP"


def wait_for_200(url: str, timeout_s: float, progress=None) -> int:
    """Poll ``url`` (a service's own health endpoint) until it answers 200, for at most ``timeout_s`` s.

    Args:
        progress: called with the seconds waited so far, every 10 s (common.poll).

    Returns:
        200, or the last status seen (0 when nothing ever answered) when the
        deadline passed; the caller raises, naming the bound.
    """
    from .poll import poll_until

    last = [0]

    def answered() -> bool:
        last[0] = http_get(url, min(HTTP_TIMEOUT_S, max(0.1, deadline - time.monotonic())))[0]
        return last[0] == 200

    deadline = time.monotonic() + timeout_s
    return 200 if poll_until(answered, timeout_s, 0.05, progress) else last[0]
