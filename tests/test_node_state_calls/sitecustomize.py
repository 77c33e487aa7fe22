"""Call recorder for tests/test_node_state.py (loaded by Python at start when this directory is on PYTHONPATH).

In the node-side process only (``python -m flatshare_ops.node`` or ``flatshare-node``), every call of
a durable-write primitive (common/durable.py) is appended to the file named by
``FLATSHARE_TEST_CALLS`` as ``PRIMITIVE<TAB>PATH``, in call order, before the primitive runs.
The test uses the sequence to know which write the Nth call of tests/faults/ fails, and when N is
past the last call (the fault cannot fire).
"""

import os
import sys

_OUT = os.environ.get("FLATSHARE_TEST_CALLS")
_ARGV = " ".join(getattr(sys, "orig_argv", sys.argv))


def _install(out: str) -> None:
    from flatshare_ops.common import durable

    def wrap(name, original):
        def recorded(*args, **kwargs):
            target = args[0] if args else kwargs.get("path", kwargs.get("link", kwargs.get("source")))
            with open(out, "a", encoding="utf-8") as f:
                f.write(f"{name}\t{target}\n")
            return original(*args, **kwargs)

        return recorded

    for name in ("write_atomic", "append_line", "rename", "replace_symlink", "remove"):
        setattr(durable, name, wrap(name, getattr(durable, name)))


if _OUT and ("flatshare_ops.node" in _ARGV or "flatshare-node" in _ARGV):
    _install(_OUT)
