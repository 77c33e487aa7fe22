"""vLLM 0.32.0's ``POST /v1/completions``, the client's side (standard library only).

What a caller sends and how it reads the answer, for every client of an engine or a gateway: the
admission probe's call through a node's gateway (node/calls.py), and the sandbox's voice worker and
caller. A streamed answer is server-sent events, one ``data: {chunk}`` per token, then (with
``stream_options.include_usage``) a usage chunk, then ``data: [DONE]``; an error met while streaming is
a ``data: {"error": ...}`` event followed by ``data: [DONE]``. The engine's side (the stand-in's
answers) is sandbox/completions.py.

Shapes from vLLM 0.32.0's ``vllm/entrypoints/openai/completion/{protocol,serving}.py`` and
``vllm/entrypoints/generate/base/serving.py`` (docs/reference/vllm.md#completions).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import asdict, dataclass
from typing import cast
from urllib.parse import urlsplit

from .text import clip

COMPLETIONS_PATH = "/v1/completions"
#: The ``vllm_xargs`` key that marks a voice turn hint (vLLM hands it to the scheduler as
#: ``request.sampling_params.extra_args["flatshare_turn_hint"]``).
TURN_HINT_XARG = "flatshare_turn_hint"


def request_body(prompt: str, max_tokens: int, stream: bool = True, turn_hint: bool = False) -> dict:
    """A completion request as the sandbox's clients send it.

    ``ignore_eos`` makes a real engine generate exactly ``max_tokens`` (a model with random weights
    may otherwise stop at once); no ``model``: vLLM answers with its served model. A streamed request
    asks for the usage chunk, so the client learns how many tokens the engine says it sent. A turn
    hint carries ``vllm_xargs.flatshare_turn_hint`` (docs/reference/vllm.md#completions).
    """
    body: dict = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if turn_hint:
        body["vllm_xargs"] = {TURN_HINT_XARG: 1}
    return body


def golden_body(prompt: str, max_tokens: int) -> dict:
    """A golden answer's request: greedy (``temperature`` 0), not streamed, and asking for the generated
    token ids (vLLM 0.32.0's ``return_token_ids``: the answer's ``choices[0].token_ids``); the engine stops
    at its end-of-sequence token as for any call, so the answers' lengths are compared too."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": False, "return_token_ids": True}


@dataclass
class CompletionOutcome:
    """What a client received for one completion request.

    Attributes:
        status: the HTTP status; 0 when no answer came (see ``refused`` and ``error``).
        refused: the connection was refused (nothing listens there).
        unanswered: the connection was closed or reset before any answer (a server going away).
        retry_after_s: a 503's ``Retry-After`` (seconds), if it had one.
        tokens: tokens received (streamed: chunks that carried text; plain: the usage's count).
        completion_tokens: the engine's own count (the usage), if it sent one.
        done: the stream ended with ``data: [DONE]`` (a plain answer: the document was complete).
        finish_reason: the last finish reason received.
        ttft_s: seconds from sending the request to the first token received.
        duration_s: seconds from sending the request to the end of the answer.
        error: what went wrong, in one line (an error event, a status, a cut stream), else None.
        token_ids: a plain answer's generated token ids, when the request asked for them
            (``return_token_ids``) and the engine sent them; else None.
    """

    status: int = 0
    refused: bool = False
    unanswered: bool = False
    retry_after_s: float | None = None
    tokens: int = 0
    completion_tokens: int | None = None
    done: bool = False
    finish_reason: str | None = None
    ttft_s: float | None = None
    duration_s: float = 0.0
    error: str | None = None
    token_ids: list[int] | None = None

    def as_dict(self) -> dict:
        """The outcome as a JSON-ready dict."""
        return asdict(self)


def post_completion(base_url: str, body: dict, request_id: str, timeout_s: float) -> CompletionOutcome:
    """``POST base_url/v1/completions`` and read the answer as it comes, never longer than ``timeout_s``.

    Args:
        base_url: ``http://HOST:PORT`` of an engine or a gateway.
        body: the request (:func:`request_body`); ``body["stream"]`` says how the answer is read.
        request_id: sent as ``X-Request-Id`` (vLLM answers ``cmpl-REQUEST_ID``).
        timeout_s: the bound on the whole exchange (connecting, waiting, reading), seconds.

    Returns:
        The outcome; nothing is raised for what the network or the server does (it is in the outcome).
    """
    url = urlsplit(base_url)
    outcome = CompletionOutcome()
    started = time.monotonic()
    deadline = started + timeout_s
    # base_url is always http://HOST:PORT (the callers build it from an address): it has a host.
    connection = http.client.HTTPConnection(cast(str, url.hostname), url.port or 80, timeout=timeout_s)
    try:
        connection.request("POST", COMPLETIONS_PATH, json.dumps(body).encode(),
                           {"Content-Type": "application/json", "X-Request-Id": request_id})
        response = connection.getresponse()
        outcome.status = response.status
        if response.status != 200:
            retry = response.getheader("Retry-After")
            outcome.retry_after_s = float(retry) if retry and retry.replace(".", "", 1).isdigit() else None
            outcome.error = f"HTTP {response.status}: {_error_message(response.read())}"
        elif body.get("stream"):
            _read_events(response, outcome, started, deadline)
        else:
            _read_document(_read_within(response, deadline), outcome, started)
    except ConnectionRefusedError:
        outcome.refused, outcome.error = True, f"connection to {url.netloc} refused"
    except (ConnectionResetError, BrokenPipeError) as err:  # http.client.RemoteDisconnected is a reset
        if outcome.status:
            outcome.error = f"{url.netloc}: the connection was reset after the answer began ({err})"
        else:
            outcome.unanswered, outcome.error = True, f"{url.netloc} closed the connection before any answer"
    except (socket.timeout, TimeoutError):
        outcome.error = f"no answer from {url.netloc} within {timeout_s:g} s"
    except (OSError, http.client.HTTPException) as err:
        outcome.error = f"{url.netloc}: {type(err).__name__}: {err}" if str(err) else f"{url.netloc}: {type(err).__name__}"
    finally:
        connection.close()
        outcome.duration_s = time.monotonic() - started
    return outcome


def _read_events(response: http.client.HTTPResponse, outcome: CompletionOutcome, started: float,
                 deadline: float) -> None:
    while True:
        if time.monotonic() > deadline:
            outcome.error = f"stream not finished within the bound, after {outcome.tokens} token(s)"
            return
        line = response.readline()
        if not line:
            outcome.error = f"stream cut after {outcome.tokens} token(s), before [DONE]"
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            outcome.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            outcome.error = f"an event that is not JSON: {data[:80]!r}"
            continue
        if "error" in event:
            outcome.error = f"error event: {_error_message(data)}"
            continue
        for choice in event.get("choices") or []:
            if choice.get("text"):
                outcome.tokens += 1
                if outcome.ttft_s is None:
                    outcome.ttft_s = time.monotonic() - started
            if choice.get("finish_reason"):
                outcome.finish_reason = choice["finish_reason"]
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            outcome.completion_tokens = usage["completion_tokens"]


#: The largest plain answer read (bytes): a completion of 256 tokens with their ids is a few KB.
MAX_DOCUMENT_BYTES = 4 << 20


def _read_within(response: http.client.HTTPResponse, deadline: float) -> bytes:
    """A plain answer's body, read by chunks until ``deadline`` (monotonic seconds): an engine that sends it a
    byte at a time cannot hold the reader past its bound (each read alone is bounded by the socket's timeout).

    A body larger than :data:`MAX_DOCUMENT_BYTES` is returned cut there (it then reads as no completion).

    Raises:
        TimeoutError: the body did not end by the deadline.
    """
    data = bytearray()
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("the answer did not end within the bound")
        chunk = response.read1(65536)
        if not chunk:
            return bytes(data)
        data += chunk
        if len(data) > MAX_DOCUMENT_BYTES:
            return bytes(data[:MAX_DOCUMENT_BYTES])


def _read_document(data: bytes, outcome: CompletionOutcome, started: float) -> None:
    try:
        document = json.loads(data)
        choice = document["choices"][0]
        outcome.completion_tokens = document["usage"]["completion_tokens"]
        if not isinstance(choice, dict):
            raise TypeError("a choice that is not an object")
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        outcome.error = f"an answer that is not a completion: {data[:80]!r}"
        return
    outcome.tokens, outcome.finish_reason, outcome.done = outcome.completion_tokens, choice.get("finish_reason"), True
    ids = choice.get("token_ids") if isinstance(choice, dict) else None
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        outcome.token_ids = ids
    outcome.ttft_s = time.monotonic() - started


def _error_message(data: bytes) -> str:
    """vLLM's error message from an error document, else the start of the text."""
    try:
        document = json.loads(data)
        error = document["error"]
        return clip(str(error["message"] if isinstance(error, dict) else error), 300)
    except (ValueError, KeyError, TypeError, RecursionError):
        return data[:120].decode(errors="replace").strip() or "no body"
