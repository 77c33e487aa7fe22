"""``python -m flatshare_ops.node``: the same as the ``flatshare-node`` command."""

from .cli import main

main()
