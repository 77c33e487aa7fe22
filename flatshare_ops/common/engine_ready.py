"""The gateway's pre-start step: wait until the node's engine answers ``/health`` with 200, within a bound.

At boot systemd starts the engine (``Type=exec``: started once exec'd) and then the gateway, while the engine
still loads its model for seconds to minutes. A gateway taking calls then can only fail them; waiting here, it
takes none until its engine answers, and its callers meet nothing listening and dial the other node
(docs/reference/stand-ins.md, "Traffic": the caller). During a release the switch starts the gateway only
once the engine answers, so the wait ends at once.

``PYTHON -m flatshare_ops.common.engine_ready URL SECONDS``: exit 0 once URL answers 200; 1 after SECONDS,
saying the last answer (the unit then fails, and ``Restart=on-failure`` tries again).
"""

from __future__ import annotations

import sys

from .http import wait_for_200


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m flatshare_ops.common.engine_ready URL SECONDS", file=sys.stderr)
        return 2
    url, seconds = argv[0], float(argv[1])
    status = wait_for_200(url, seconds, lambda waited: print(f"waiting for {url} to answer 200 ({waited:.0f} s of "
                                                             f"{seconds:g} s)", flush=True))
    if status == 200:
        return 0
    print(f"{url} did not answer 200 within {seconds:g} s ({f'last answer {status}' if status else 'no answer'})",
          flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
