"""vLLM 0.32.0's ``POST /v1/completions`` as the sandbox speaks it (standard library only).

One module for both sides, so that the stand-in engine and its clients cannot drift apart:

- the engine's side: reading a request (:func:`read_request`) and the documents vLLM answers
  with: a streamed completion is server-sent events, one ``data: {chunk}`` per token, then
  (with ``stream_options.include_usage``) a usage chunk, then ``data: [DONE]``; an error met
  while streaming is a ``data: {"error": ...}`` event followed by ``data: [DONE]``;
- the clients' side (the gateway forwards the bytes; the voice worker, the caller and the admission
  probe read them) is common/completions.py: :func:`request_body` and :func:`post_completion`.

Shapes from vLLM 0.32.0's ``vllm/entrypoints/openai/completion/{protocol,serving}.py`` and
``vllm/entrypoints/generate/base/serving.py`` (docs/reference/vllm.md#completions).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass

from ..common.completions import TURN_HINT_XARG

#: vLLM's ``max_tokens`` when a request gives none.
DEFAULT_MAX_TOKENS = 16
#: The finish reasons vLLM 0.32.0 knows (``vllm/v1/engine/__init__.py``, ``FinishReason``).
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
DONE_EVENT = b"data: [DONE]\n\n"
EVENT_STREAM = "text/event-stream; charset=utf-8"


# --- the engine's side ----------------------------------------------------------------------------


class RequestRefused(Exception):
    """A request vLLM would refuse: its HTTP status and vLLM's error document."""

    def __init__(self, status: int, err_type: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.document = status, error_document(message, err_type, status, param)


@dataclass(frozen=True)
class CompletionRequest:
    """What the stand-in engine reads from a completion request.

    Attributes:
        request_id: ``X-Request-Id``, else the body's ``request_id``, else a new one (vLLM's order);
            the answer's id is ``cmpl-`` + this.
        model: the served model name it is answered as.
        prompt_tokens: the prompt's length in tokens (the stand-in counts words).
        max_tokens: tokens to generate.
        stream: server-sent events or one JSON document.
        include_usage: ``stream_options.include_usage``: a usage chunk before ``[DONE]``.
        turn_hint: ``vllm_xargs.flatshare_turn_hint`` was given and is not 0/false.
        prompt: the prompt as sent (the stand-in's token ids are drawn from it).
        return_token_ids: the answer carries the generated token ids (vLLM's ``return_token_ids``).
    """

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    turn_hint: bool
    prompt: object = None
    return_token_ids: bool = False


def read_request(document: object, header_id: str | None, served_names: list[str]) -> CompletionRequest:
    """Read a ``POST /v1/completions`` body as vLLM 0.32.0 reads the fields the stand-in uses.

    Raises:
        RequestRefused: 400 for a malformed field, 404 for a model the engine does not serve
            (vLLM's message: "The model `X` does not exist. Valid aliases: ...").
    """
    if not isinstance(document, dict):
        raise RequestRefused(400, "BadRequestError", "the request body must be a JSON object")
    model = document.get("model")
    if model not in (None, "", *served_names):
        raise RequestRefused(404, "NotFoundError",
                             f"The model `{model}` does not exist. Valid aliases: {', '.join(served_names)}.", "model")
    prompt = document.get("prompt")
    if isinstance(prompt, str):
        prompt_tokens = len(prompt.split())
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, int)) and not isinstance(p, bool)
                                                     for p in prompt):
        prompt_tokens = sum(len(p.split()) if isinstance(p, str) else 1 for p in prompt)
    else:
        raise RequestRefused(400, "BadRequestError", "prompt must be a string, a list of strings or of token ids",
                             "prompt")
    max_tokens = document.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestRefused(400, "BadRequestError", f"max_tokens must be at least 1, got {max_tokens!r}.",
                             "max_tokens")
    stream = document.get("stream") or False
    options = document.get("stream_options") or {}
    xargs = document.get("vllm_xargs") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict) or not isinstance(xargs, dict):
        raise RequestRefused(400, "BadRequestError", "stream must be a boolean, stream_options and vllm_xargs objects")
    if options and not stream:
        raise RequestRefused(400, "BadRequestError", "Stream options can only be defined when `stream=True`.",
                             "stream_options")
    body_id = document.get("request_id")
    request_id = header_id or (body_id if isinstance(body_id, str) and body_id else uuid.uuid4().hex)
    return CompletionRequest(
        request_id=request_id, model=model or served_names[0], prompt_tokens=max(prompt_tokens, 1),
        max_tokens=max_tokens, stream=stream, include_usage=bool(options.get("include_usage")),
        turn_hint=xargs.get(TURN_HINT_XARG) not in (None, 0, False, "0", "false"), prompt=prompt,
        return_token_ids=document.get("return_token_ids") is True)


def error_document(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    """vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def _event(document: dict) -> bytes:
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"


def chunk_event(request: CompletionRequest, created: int, text: str, finish_reason: str | None) -> bytes:
    """One streamed token: vLLM's ``CompletionStreamResponse`` with one choice."""
    return _event({
        "id": f"cmpl-{request.request_id}", "object": "text_completion", "created": created, "model": request.model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
                     "prompt_token_ids": None, "token_ids": None}]})


def usage_event(request: CompletionRequest, created: int, completion_tokens: int) -> bytes:
    """The usage chunk vLLM sends before ``[DONE]`` when ``stream_options.include_usage`` is set."""
    return _event({
        "id": f"cmpl-{request.request_id}", "object": "text_completion", "created": created, "model": request.model,
        "choices": [], "usage": _usage(request, completion_tokens)})


def error_event(message: str = "Internal server error") -> bytes:
    """What vLLM streams when a request finishes with ``error`` (then ``[DONE]``)."""
    return _event(error_document(message, "InternalServerError", 500))


def answer_token_ids(prompt: object, count: int, shift_from: int | None = None) -> list[int]:
    """The stand-in's generated token ids for ``prompt``: the same for the same prompt on every stand-in (as
    greedy decoding of the same weights is), ``count`` of them, each below 50,000; from position
    ``shift_from`` (0 for the first) on, each is one more (a node whose answers changed:
    ``FLATSHARE_STANDIN_ANSWER_SHIFT``)."""
    seed = hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).digest()
    ids = [int.from_bytes(hashlib.sha256(seed + i.to_bytes(4, "big")).digest()[:4], "big") % 50_000
           for i in range(count)]
    return [v + 1 if shift_from is not None and i >= shift_from else v for i, v in enumerate(ids)]


def completion_document(request: CompletionRequest, created: int, text: str, finish_reason: str,
                        completion_tokens: int, token_ids: list[int] | None = None) -> dict:
    """vLLM's ``CompletionResponse`` (a request without ``stream``); ``token_ids`` when the request asked for
    them (``return_token_ids``)."""
    return {
        "id": f"cmpl-{request.request_id}", "object": "text_completion", "created": created, "model": request.model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
                     "token_ids": token_ids, "prompt_logprobs": None, "prompt_token_ids": None}],
        "service_tier": None, "system_fingerprint": None, "usage": _usage(request, completion_tokens),
        "kv_transfer_params": None}


def _usage(request: CompletionRequest, completion_tokens: int) -> dict:
    return {"prompt_tokens": request.prompt_tokens, "total_tokens": request.prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}
