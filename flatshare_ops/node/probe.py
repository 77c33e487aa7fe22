"""What another node's admission to drain asks of this one: does it take calls, and does a release hold it?

docs/reference/release-protocol.md ("Admission to drain"): a node may drain
only while enough other nodes take calls and are not themselves being
released. Whether a release holds this node is read from the kernel's lock
table (:func:`.lock.lock_reading`, adr/0011), never from a pid in a file, and
reading it never takes the lock.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

from ..errors import NodeStateError
from .context import NodeContext
from .lock import lock_reading


def built_module(ctx: NodeContext, path: str | None = None) -> dict:
    """The serve module this node built: ``path`` (the profile's ``module.path``, as bootstrap built it),
    else the active release's.

    Returns:
        ``{"node", "path", "sha256", "modified_at"}``, or ``{"node", "error"}`` naming what is missing.
    """
    from ..common.hashing import sha256_file
    from .store import current_release
    from .calls import active_serving

    if path is None:
        try:
            current = current_release(ctx.state_dir)
        except NodeStateError as err:
            return {"node": ctx.node, "error": str(err)}
        serving = active_serving(ctx, current)
        if serving is None and current is not None:
            from .bundle import stored_files

            try:
                stored_files(ctx, current)
            except NodeStateError as err:  # never a path read from a release that is not what its id says
                return {"node": ctx.node, "error": f"the active release is damaged: {err}; give the module's path"}
        if serving is None:
            return {"node": ctx.node, "error": "no active release and no module path given: bootstrap the node"}
        path = cast(str, (serving.get("module") or {}).get("path"))  # active_serving checked its shape: a str
    try:
        return {"node": ctx.node, "path": path, "sha256": sha256_file(Path(path)), "modified_at": os.stat(path).st_mtime}
    except OSError as err:
        return {"node": ctx.node, "error": f"{path}: cannot read the built module ({err.strerror or err})"}
    except TypeError:
        return {"node": ctx.node, "error": "the active release names no module path; give it (--path)"}


#: This machine's id (machine-id(5)): set once at installation, the same for every name or address reaching it.
MACHINE_ID = "/etc/machine-id"


def node_identity(ctx: NodeContext) -> str | None:
    """What tells this node from every other, whatever name, address, port or SSH host key reached it: this
    machine's id (:data:`MACHINE_ID`) with the device and inode of the node's state directory (one machine may
    hold several nodes, as the sandbox's does). ``"MACHINE:DEV:INODE"``; None when the state directory cannot
    be read (then only the SSH host key tells nodes apart)."""
    from ..common.files import Damaged, read_bytes

    try:  # bounded and never blocking, as every file the node reads (a FIFO there is no id)
        machine = (read_bytes(Path(MACHINE_ID), allow_symlink=True, limit=64) or b"").decode("ascii", "replace").strip()
    except Damaged:
        machine = ""
    try:
        st = os.stat(ctx.state_dir)
    except OSError:
        return None
    import socket

    return f"{machine or socket.gethostname()}:{st.st_dev}:{st.st_ino}"


def probe(ctx: NodeContext) -> dict:
    """This node's answer to an admission check.

    Returns:
        ``{"node", "takes_calls": bool, "problems": [why not], "locked": bool, "holder": str | None,
        "gateway": URL | None, "node_id": str | None, "check_runs": dict | None, "load": dict | None}``; ``locked`` is true too when the lock table cannot be
        read here (``holder`` says so); ``gateway`` is the gateway URL the answer was read at (the active
        release's ``gateway.url``), for the operator's side to check that it names this node; ``node_id``:
        :func:`node_identity`, so that one node reached by two names is counted once; ``check_runs``:
        :func:`check_runs`; ``load``: :func:`engine_load` when the node takes calls, else None.
    """
    from .store import current_release
    from .calls import active_serving, node_calls

    locked, holder = lock_reading(ctx)
    gateway, serving = None, None
    try:
        serving = active_serving(ctx, current_release(ctx.state_dir))
        gateway = (serving.get("gateway") or {}).get("url") if serving else None
        calls = node_calls(ctx, serving)
        takes, problems = calls.takes is True, calls.reasons
    except NodeStateError as err:
        takes, problems = False, [str(err)]
    # Anything not seen serving counts as not taking calls (docs/reference/release-protocol.md).
    return {"node": ctx.node, "takes_calls": takes, "problems": problems, "locked": locked, "holder": holder,
            "gateway": gateway if isinstance(gateway, str) else None, "node_id": node_identity(ctx),
            "check_runs": check_runs(ctx), "load": engine_load(serving) if takes else None}


def engine_load(serving: dict | None) -> dict:
    """What the node's engine carries now, from its own ``GET /metrics`` (vLLM's gauges,
    common/vllm_metrics.py; docs/reference/vllm.md#metrics) and its command line's ``--max-num-seqs``.

    Returns:
        ``{"running": requests in its batches, "waiting": requests queued, "max_num_seqs": int or None (not on
        its command line: vLLM's own default, not known here), "kv_cache_usage": share 0-1 or None (not
        exported)}``, summed over the engine's data-parallel engines; or ``{"error": why not}``.
    """
    from ..common import vllm_metrics as vm
    from ..common.http import http_fetch
    from ..common.text import one_line

    if not serving:
        return {"error": "no readable active release: its engine's address is not known"}
    url = serving["engine"]["url"] + "/metrics"
    status, body, why = http_fetch(url, METRICS_TIMEOUT_S)
    if status != 200:
        return {"error": f"{url} {'answered ' + str(status) if status else one_line(why)}"}
    found: dict[str, list[float]] = {vm.REQUESTS_RUNNING: [], vm.REQUESTS_WAITING: [], vm.KV_CACHE_USAGE: []}
    try:
        for name, _labels, value in vm.read_samples(body.decode("utf-8", errors="replace")):
            if name in found:
                found[name].append(value)
    except ValueError as err:
        return {"error": f"{url}: not Prometheus' text format ({one_line(err)})"}
    if not found[vm.REQUESTS_RUNNING] or not found[vm.REQUESTS_WAITING]:
        return {"error": f"{url} has no {vm.REQUESTS_RUNNING} or {vm.REQUESTS_WAITING}"}
    from ..common import vllm_argv

    try:  # the command line as the engine's vLLM reads it (its option table), never scanned by hand
        seqs = vllm_argv.read_argv(list(serving["engine"].get("argv") or []),
                                   str(serving.get("vllm_release", vllm_argv.DEFAULT_RELEASE))).values.get("max_num_seqs")
    except (ValueError, TypeError):
        seqs = None
    seqs = seqs if isinstance(seqs, int) and not isinstance(seqs, bool) else None
    import math

    if not all(math.isfinite(v) for values in found.values() for v in values):
        return {"error": f"{url} gives a gauge that is not a finite number"}
    usage = found[vm.KV_CACHE_USAGE]
    return {"running": int(sum(found[vm.REQUESTS_RUNNING])), "waiting": int(sum(found[vm.REQUESTS_WAITING])),
            "max_num_seqs": seqs, "kv_cache_usage": max(usage) if usage else None}


def check_runs(ctx: NodeContext) -> dict | None:
    """serving-check's runs from its timer, as this node's systemd recorded them (org.freedesktop.systemd1(5)):
    ``{"timer": the timer's LoadState/ActiveState ("not-found", "active", "inactive", ...), "result": the
    service's last Result ("success", "exit-code", "signal", "timeout", ...), "status": ExecMainStatus (the exit
    status, or the signal's number when "code" is "killed"/"dumped"), "code": "exited"|"killed"|"dumped"|None,
    "age_s": seconds since its last run ended, by this node's clock, or None before its first run and while a run
    is under way (systemd clears the exit of the run before when the next starts), "running": whether one is under
    way}``; None when systemd does not answer."""
    import time

    from ..common.units import CHECK_SERVICE, CHECK_TIMER
    from ..errors import SystemdError

    queries = [(CHECK_TIMER, "Unit", "LoadState"), (CHECK_TIMER, "Unit", "ActiveState"),
               (CHECK_SERVICE, "Service", "Result"), (CHECK_SERVICE, "Service", "ExecMainStatus"),
               (CHECK_SERVICE, "Service", "ExecMainCode"), (CHECK_SERVICE, "Service", "ExecMainExitTimestamp"),
               (CHECK_SERVICE, "Unit", "ActiveState")]
    try:
        got = ctx.manager.properties(queries)
    except SystemdError:
        return None
    load, active = got[f"{CHECK_TIMER}/LoadState"], got[f"{CHECK_TIMER}/ActiveState"]
    exited_us = int(got[f"{CHECK_SERVICE}/ExecMainExitTimestamp"] or 0)
    code = {1: "exited", 2: "killed", 3: "dumped"}.get(int(got[f"{CHECK_SERVICE}/ExecMainCode"] or 0))  # waitid(2)'s CLD_*
    return {"timer": active if load == "loaded" else load, "result": got[f"{CHECK_SERVICE}/Result"],
            "status": int(got[f"{CHECK_SERVICE}/ExecMainStatus"] or 0), "code": code,
            "age_s": round(time.time() - exited_us / 1e6, 1) if exited_us else None,
            "running": got[f"{CHECK_SERVICE}/ActiveState"] in ("activating", "active", "reloading")}


#: The bound of one scrape of the engine's /metrics (seconds).
METRICS_TIMEOUT_S = 5.0


def engine_metrics(ctx: NodeContext) -> dict:
    """The node's engine ``GET /metrics`` (its release's engine URL), for a canary analysis; the engine listens
    where only the node reaches it (docs/reference/vllm.md#metrics).

    Returns:
        ``{"node", "at" (Unix seconds), "release" (the active release's id), "status", "text"}``, or
        ``{"node", "at", "release", "error"}`` naming what is missing.
    """
    import time

    from ..common.http import http_fetch
    from ..common.text import one_line

    at = time.time()
    release, serving = _active_engine(ctx, at)
    if serving is None:
        return release
    url = serving["engine"]["url"] + "/metrics"
    status, body, why = http_fetch(url, METRICS_TIMEOUT_S)
    if status != 200:
        heard = f"answered {status}" if status else one_line(why)
        return {"node": ctx.node, "at": at, "release": release, "error": f"{url} {heard}"}
    return {"node": ctx.node, "at": at, "release": release, "status": status,
            "text": body.decode("utf-8", errors="replace")}


def engine_answers(ctx: NodeContext, prompts_json: str, max_tokens: int, budget_s: float = 25.0) -> dict:
    """The node's engine's greedy answers to golden prompts (a canary analysis's golden answers), each a
    ``POST /v1/completions`` with ``temperature`` 0 and vLLM 0.32.0's ``return_token_ids``
    (common/completions.py :func:`golden_body`, docs/reference/vllm.md#completions), one after another.

    Args:
        prompts_json: the prompts, a JSON list of 1 to 16 strings (as the operator's profile gives them, on the
            command's stdin).
        max_tokens: tokens generated for each, 1 to 256.
        budget_s: the bound on all the answers together (seconds; the operator's command bound less a margin):
            a prompt not answered within it is said as such.

    Returns:
        ``{"node", "at" (Unix seconds), "release", "answers": [{"token_ids": [int, ...]} or {"error"}, ...]}``
        (one answer per prompt, in order), or ``{"node", "at", "release"?, "error"}`` naming what is missing.
    """
    import json
    import time

    from ..common.completions import golden_body, post_completion

    at = time.time()
    try:
        prompts = json.loads(prompts_json)
    except ValueError as err:
        return {"node": ctx.node, "at": at, "error": f"the prompts on stdin are not JSON ({err})"}
    if (not isinstance(prompts, list) or not 1 <= len(prompts) <= 16
            or not all(isinstance(p, str) and 1 <= len(p) <= 2000 for p in prompts) or not 1 <= max_tokens <= 256):
        return {"node": ctx.node, "at": at,
                "error": "the prompts on stdin must be a JSON list of 1 to 16 strings of 1 to 2000 characters, and "
                         "--max-tokens 1 to 256"}
    release, serving = _active_engine(ctx, at)
    if serving is None:
        return release
    answers: list[dict] = []
    deadline = time.monotonic() + budget_s
    for number, prompt in enumerate(prompts, 1):
        left = deadline - time.monotonic()
        if left < 1:
            answers.append({"error": f"not asked: the answers' {budget_s:g} s ran out"})
            continue
        outcome = post_completion(serving["engine"]["url"], golden_body(prompt, max_tokens),
                                  f"flatshare-golden-{int(at)}-{number}", left)
        if outcome.error is not None or outcome.token_ids is None:
            answers.append({"error": outcome.error or "the answer carries no token_ids (vLLM's return_token_ids)"})
        else:
            answers.append({"token_ids": outcome.token_ids})
    return {"node": ctx.node, "at": at, "release": release, "answers": answers}


def _active_engine(ctx: NodeContext, at: float):
    """(the active release's id, its ``serving.json``) for asking its engine; when it cannot be asked,
    (the answer saying why: ``{"node", "at", "release"?, "error"}``, None)."""
    from .calls import active_serving
    from .store import current_release

    try:
        release = current_release(ctx.state_dir)
        serving = active_serving(ctx, release)
    except NodeStateError as err:
        return {"node": ctx.node, "at": at, "error": str(err)}, None
    if serving is None:
        return {"node": ctx.node, "at": at, "release": release,
                "error": "no readable active release: its engine's address is not known"}, None
    return release, serving
