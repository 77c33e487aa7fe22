"""Stand-in for the make-room serve module's build, for the sandbox only.

The engine unit's pre-start step runs it, as production builds the real
module at engine start. It writes a deterministic module file atomically, so
the sandbox profile can pin its sha256. ``--patch`` changes the content (and
so the hash), as a make-room patch change does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..common.durable import write_atomic

MODULE_NAME = "flatshare_make_room_serve"


def module_source(patch: str = "0") -> bytes:
    """The bytes the stand-in build writes for a given patch level."""
    return (
        '"""Stand-in make-room serve module (sandbox build)."""\n'
        f"PATCH = {patch!r}\n\n\n"
        "class AsyncScheduler:\n"
        '    """Stand-in for make-room\'s scheduler class."""\n'
    ).encode()


def main(argv: list[str] | None = None) -> None:
    """``python -m flatshare_ops.sandbox.module_build --out DIR [--patch P]``."""
    parser = argparse.ArgumentParser(prog="module_build")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--patch", default="0")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / f"{MODULE_NAME}.py", module_source(args.patch))


if __name__ == "__main__":
    main()
