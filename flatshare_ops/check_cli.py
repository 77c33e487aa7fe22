"""``serving-check``: verify the running engine against the node's active release.

Not built yet (issue 4). Until then it answers UNKNOWN, exit 3, by the Nagios
plugin convention for a check that cannot run.
"""

import sys


def main() -> None:
    """Console-script entry point."""
    print("SERVING-CHECK UNKNOWN - serving-check is not implemented yet")
    sys.exit(3)
