"""Names of the files a node keeps under its state directory (see releases/README.md).

Constants only, so that serving-check can find them without importing more.
"""

RELEASES = "releases"  # STATE_DIR/releases
CURRENT = "current"  # releases/current -> <id>, the active release
JOURNAL = "switching.json"  # releases/switching.json, the journal of a switch in progress
JOURNAL_SCHEMA = 2  # the journal's schema: node/journal.py reads only it, and serving-check names another as damaged
LOCK = ".lock"  # releases/.lock, the release lock (filelock)
LOCK_HOLDER = "lock.json"  # releases/lock.json, who holds the lock
HISTORY = "history.jsonl"  # releases/history.jsonl, one line per finished release
LOG = "release.log"  # releases/release.log, every line a release printed, timestamped
