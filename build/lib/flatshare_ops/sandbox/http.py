"""A small threaded HTTP server the stand-ins share (standard library only)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qs, urlsplit

#: A route: (method, path) -> handler(query) -> (status, headers, body bytes)
Handler = Callable[[dict[str, list[str]]], tuple[int, dict[str, str], bytes]]


def json_body(status: int, document: object, headers: dict[str, str] | None = None):
    """A JSON response triple for a route handler."""
    return status, {"Content-Type": "application/json", **(headers or {})}, (json.dumps(document) + "\n").encode()


def serve(host: str, port: int, routes: dict[tuple[str, str], Handler]) -> ThreadingHTTPServer:
    """Bind a threaded HTTP server answering ``routes``; the caller runs ``serve_forever``."""

    class _Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, method: str) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            route = routes.get((method, url.path))
            if route is None:
                status, headers, body = json_body(404, {"error": f"no route {method} {url.path}"})
            else:
                status, headers, body = route(parse_qs(url.query))
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def log_message(self, format: str, *args: object) -> None:  # keep the journal quiet
            pass

    ThreadingHTTPServer.allow_reuse_address = True
    ThreadingHTTPServer.daemon_threads = True
    return ThreadingHTTPServer((host, port), _Handler)
