"""Preflight: before a node is drained for an engine restart, can the new engine start at all?

A drain costs calls, and an engine that cannot start keeps the node drained
for its whole start budget (900 s in production) before the release fails.
So, before anything is drained, on the node itself:

- the engine's command line is parsed by the node's own engine venv, with
  vLLM's own ``vllm serve`` argument parser (no model load, no GPU):
  ``ENGINE_VENV/bin/python flatshare_ops/common/vllm_serve_parse.py parse``,
  the script that runs unchanged on vLLM 0.32.0 and 0.33.0; a rejection
  refuses the release with vLLM's own message;
- the model path exists (when it is a path), and the speculative draft model's;
- the serve module's build command exists and is executable.

The real parser costs about 7 s of CPU per process, so it runs only here (and
in the tests), once per release that restarts the engine.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ..common.files import loads

#: How long the parse may take (seconds): importing vLLM is most of it.
PARSE_TIMEOUT_S = 180.0
#: The parse script, run by the engine venv's interpreter.
PARSE_SCRIPT = Path(__file__).resolve().parent.parent / "common" / "vllm_serve_parse.py"


def parse_with_venv(venv: Path, words: list[str], timeout_s: float = PARSE_TIMEOUT_S, progress=None) -> dict:
    """Parse ``vllm serve WORDS`` with the vLLM installed in ``venv``.

    Args:
        venv: the engine venv (its ``bin/python`` runs the parse script).
        words: the words after ``serve``, model first.
        timeout_s: the parse's bound, in seconds.
        progress: called with the seconds waited, at :func:`common.poll.progress_every` (vLLM's import
            takes several).

    Returns:
        The script's result: ``{"ok": True, "namespace": {...}}`` or ``{"ok": False, "error": MESSAGE}``;
        ``{"ok": False, "error": ..., "preflight": True}`` when the parse itself could not run
        (no interpreter, timeout, no JSON): the message says which, naming the bound.
    """
    python = Path(venv) / "bin" / "python"
    if not os.access(python, os.X_OK):
        return {"ok": False, "preflight": True, "error": f"{python} is not an executable interpreter"}
    import tempfile

    from ..common.poll import poll_until

    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        try:
            process = subprocess.Popen([str(python), str(PARSE_SCRIPT), "parse"], stdin=subprocess.PIPE,
                                       stdout=stdout, stderr=stderr, text=True,
                                       env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
        except OSError as err:
            return {"ok": False, "preflight": True, "error": f"cannot run {python}: {err.strerror or err}"}
        try:
            process.stdin.write(json.dumps(words))
            process.stdin.close()
            if poll_until(lambda: process.poll() is not None, timeout_s, 0.02, progress) is None:
                return {"ok": False, "preflight": True, "error": f"vLLM's parser did not answer within {timeout_s:g} s"}
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()
        stdout.seek(0)
        stderr.seek(0)
        output, errors = stdout.read(), stderr.read()
    try:
        answer = loads(output)  # bounded, RFC 8259 numbers (common/files.py)
        if not isinstance(answer, dict) or "ok" not in answer:
            raise ValueError("not a parse result")
        return answer
    except ValueError:
        tail = (errors.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "preflight": True, "error": f"the parse script exited {process.returncode}: {tail}"}


def problems(serving: dict, progress=None) -> list[str]:
    """Why the release's engine cannot start on this node (empty when it can), one line each."""
    engine = serving.get("engine", {})
    argv = list(engine.get("argv", []))
    venv = Path(engine.get("venv", "/nonexistent"))
    release = serving.get("vllm_release", "?")
    found = []
    if "serve" not in argv[:3]:
        return [f"the engine's command line is not 'vllm serve MODEL ...': {argv[:3]}"]
    words = argv[argv.index("serve") + 1 :]
    model = words[0] if words else ""
    if model.startswith("/") and not Path(model).exists():
        found.append(f"the model path {model} does not exist on this node")
    if "--speculative-config" in words:
        try:
            draft = json.loads(words[words.index("--speculative-config") + 1]).get("model", "")
        except (ValueError, IndexError, AttributeError):
            draft = ""
        if isinstance(draft, str) and draft.startswith("/") and not Path(draft).exists():
            found.append(f"the speculative draft model path {draft} does not exist on this node")
    build = (serving.get("module") or {}).get("build_command") or []
    if build and not (Path(build[0]).is_file() and os.access(build[0], os.X_OK)):
        found.append(f"the serve module's build command {build[0]} is missing or not executable")
    answer = parse_with_venv(venv, words, progress=progress)
    if not answer.get("ok"):
        if answer.get("preflight"):
            found.append(f"vLLM's parser in {venv} could not check the command line: {answer['error']}")
        else:
            found.append(f"vLLM {release} in {venv} rejects the engine's command line: {answer['error']}")
    return found
