"""A small threaded HTTP server the stand-ins share (standard library only).

A route is ``(method, path) -> handler(request) -> (status, headers, body)``. The body is bytes
(sent with ``Content-Length``) or a :class:`Streamed` (sent as it is produced, HTTP/1.1 chunked
transfer coding, as vLLM's server sends a streamed completion).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class Request:
    """One request as a route sees it: ``query`` is ``parse_qs``'s dict, ``body`` the raw bytes."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: Message
    body: bytes

    def json(self) -> object:
        """The body as JSON (an empty body is ``{}``).

        Raises:
            ValueError: the body is not JSON (the message says where).
        """
        if not self.body.strip():
            return {}
        return json.loads(self.body)


class Streamed:
    """A response body sent chunk by chunk as ``chunks`` yields it.

    ``on_close(complete)`` runs once the response has been written to its end (``complete``
    True) or the client went away (False), after ``chunks.close()`` if it has one (a generator
    then sees ``GeneratorExit`` at the ``yield`` it was stopped at).
    """

    def __init__(self, chunks: Iterable[bytes], on_close: Callable[[bool], None] | None = None) -> None:
        self.chunks = chunks
        self.on_close = on_close


#: A route's handler.
Handler = Callable[[Request], tuple[int, dict[str, str], "bytes | Streamed"]]


def json_body(status: int, document: object, headers: dict[str, str] | None = None):
    """A JSON response triple for a route handler."""
    return status, {"Content-Type": "application/json", **(headers or {})}, (json.dumps(document) + "\n").encode()


def serve(host: str, port: int, routes: dict[tuple[str, str], Handler]) -> "Server":
    """Bind a threaded HTTP server answering ``routes``; the caller runs ``serve_forever``.

    A handler that raises is answered 500 with the exception's one line (and the line on stderr).
    """

    class _Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, method: str) -> None:
            url = urlsplit(self.path)
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0:
                self._send(*json_body(400, {"error": "Content-Length is not a byte count"}))
                self.close_connection = True
                return
            body = self.rfile.read(length) if length else b""
            route = routes.get((method, url.path))
            if route is None:
                self._send(*json_body(404, {"error": f"no route {method} {url.path}"}))
                return
            try:
                answer = route(Request(method, url.path, parse_qs(url.query), self.headers, body))
            except Exception as err:  # noqa: BLE001 (a stand-in's bug: answered, and said on stderr)
                line = f"{method} {url.path}: {type(err).__name__}: {err}"
                print(f"stand-in: {line}", file=sys.stderr, flush=True)
                answer = json_body(500, {"error": line})
            self._send(*answer)

        def _send(self, status: int, headers: dict[str, str], body: bytes | Streamed) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            if isinstance(body, Streamed):
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._stream(body)
                return
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _stream(self, body: Streamed) -> None:
            complete = False
            try:
                for chunk in body.chunks:
                    if chunk:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                complete = True
            except OSError:  # the client went away (EPIPE, ECONNRESET)
                self.close_connection = True
            except Exception as err:  # noqa: BLE001 (a stand-in's bug mid-stream: the stream is cut, and said)
                print(f"stand-in: stream cut: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                self.close_connection = True
            finally:
                close = getattr(body.chunks, "close", None)
                if close is not None:
                    close()
                if body.on_close is not None:
                    body.on_close(complete)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def log_message(self, format: str, *args: object) -> None:  # keep the journal quiet
            pass

    return Server((host, port), _Handler)


class Server(ThreadingHTTPServer):
    """A threaded HTTP server that knows how many connections its threads are answering, so that it
    can stop without cutting one it has taken (:meth:`close_gracefully`)."""

    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type) -> None:
        super().__init__(address, handler)
        self.answering = 0
        self.answered = threading.Condition()

    def process_request(self, request, client_address) -> None:  # the accepting thread: counted before the thread starts
        with self.answered:
            self.answering += 1
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.answered:
                self.answering -= 1
                self.answered.notify_all()

    def close_gracefully(self, timeout_s: float) -> None:
        """Stop taking connections without cutting those already made: stop the accepting loop (run it in
        another thread), answer the connections waiting in the listening socket's queue, close it (a
        connection after that is refused), then wait up to ``timeout_s`` seconds for the answers."""
        self.shutdown()
        self.socket.setblocking(False)
        while True:
            try:
                request, client_address = self.socket.accept()
            except OSError:  # BlockingIOError: the queue is empty
                break
            request.setblocking(True)
            self.process_request(request, client_address)
        self.socket.close()
        deadline = time.monotonic() + timeout_s
        with self.answered:
            while self.answering and time.monotonic() < deadline:
                self.answered.wait(max(0.0, deadline - time.monotonic()))
