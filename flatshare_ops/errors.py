"""The one exception type the CLI turns into a one-line message and exit code.

Every error an operator can cause (bad profile, corrupt journal, missing unit)
is raised as a :class:`FlatshareError` whose message already reads like a note
from a colleague: the place, the rule, the way out (STYLE.md section 5).
"""


class FlatshareError(Exception):
    """An operator-facing error: ``str(err)`` is the whole one-line message.

    ``exit_code`` is what the CLI exits with (2 for bad input by default).
    """

    exit_code = 2


class ProfileError(FlatshareError):
    """A profile file is missing, malformed, or breaks a schema rule."""
