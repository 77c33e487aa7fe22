"""What another node's admission to drain asks of this one: does it take calls, and does a release hold it?

docs/reference/release-protocol.md ("Admission to drain"): a node may drain
only while enough other nodes take calls and are not themselves being
released. Whether a release holds this node is read from the kernel's lock
table (:func:`.lock.held_by`), never from a pid in a file, and reading it
never takes the lock.
"""

from __future__ import annotations

import os

from ..errors import NodeStateError
from .context import NodeContext
from .lock import describe_lock, held_by


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
        path = (serving.get("module") or {}).get("path")
    try:
        return {"node": ctx.node, "path": path, "sha256": sha256_file(path), "modified_at": os.stat(path).st_mtime}
    except OSError as err:
        return {"node": ctx.node, "error": f"{path}: cannot read the built module ({err.strerror or err})"}
    except TypeError:
        return {"node": ctx.node, "error": "the active release names no module path; give it (--path)"}


def probe(ctx: NodeContext) -> dict:
    """This node's answer to an admission check.

    Returns:
        ``{"node", "takes_calls": bool, "problems": [why not], "locked": bool, "holder": str | None}``.
    """
    from .store import current_release
    from .calls import active_serving, node_calls

    pid = held_by(ctx.lock_path)
    try:
        calls = node_calls(ctx, active_serving(ctx, current_release(ctx.state_dir)))
        takes, problems = calls.takes is True, calls.reasons
    except NodeStateError as err:
        takes, problems = False, [str(err)]
    # Anything not seen serving counts as not taking calls (docs/reference/release-protocol.md).
    return {"node": ctx.node, "takes_calls": takes, "problems": problems, "locked": pid is not None,
            "holder": describe_lock(ctx, pid) if pid is not None else None}
