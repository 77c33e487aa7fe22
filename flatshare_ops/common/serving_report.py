"""serving-check's report as data: the statuses, one finding, the node's state and a run's findings (standard library
only).

serving-check (check/) makes reports and prints them (``--json``: :meth:`Report.to_json`); the operator's side
(``flatshare check``) and the node's release (its serving-check step runs serving-check, the program) read them
back with :meth:`Report.from_json`. The statuses and exit codes are the Nagios plugin guidelines' (exit 0 OK,
1 WARNING, 2 CRITICAL, 3 UNKNOWN; docs/reference/monitoring.md).

Plain classes, not dataclasses: importing dataclasses pulls in inspect (about 5 ms), and serving-check runs every
minute on every node.
"""

from __future__ import annotations

OK, WARNING, CRITICAL, UNKNOWN = "OK", "WARNING", "CRITICAL", "UNKNOWN"
#: The Nagios exit code of each status.
EXIT_CODES = {OK: 0, WARNING: 1, CRITICAL: 2, UNKNOWN: 3}
#: Which status wins a summary: CRITICAL outranks UNKNOWN (the engine is known bad).
SEVERITY = {OK: 0, WARNING: 1, UNKNOWN: 2, CRITICAL: 3}


def worst(statuses) -> str:
    """The most severe of ``statuses`` (OK when there are none)."""
    return max(statuses, key=SEVERITY.__getitem__, default=OK)


class Finding:
    """One check's result.

    Attributes:
        check: the check's name (``engine_unit``, ``flags``, ``vllm_release``...).
        status: ``OK``, ``WARNING``, ``CRITICAL`` or ``UNKNOWN``.
        summary: one line for people.
        details: one line per difference (``--flag: running X, profile Y``).
    """

    __slots__ = ("check", "status", "summary", "details")

    def __init__(self, check: str, status: str, summary: str, details: list[str] | None = None) -> None:
        self.check, self.status, self.summary, self.details = check, status, summary, list(details or [])

    def to_json(self) -> dict:
        """The finding as a JSON-ready dict."""
        return {"check": self.check, "status": self.status, "summary": self.summary, "details": self.details}

    @classmethod
    def from_json(cls, document: dict) -> "Finding":
        """A finding from :meth:`to_json`'s dict.

        Raises:
            KeyError, TypeError: not a finding.
        """
        status = document["status"]
        if status not in EXIT_CODES:
            raise TypeError(f"unknown status {status!r}")
        return cls(str(document["check"]), status, str(document["summary"]), [str(d) for d in document["details"]])

    def __repr__(self) -> str:
        return f"Finding({self.check!r}, {self.status!r}, {self.summary!r}, {self.details!r})"


class NodeState:
    """What serving-check saw of the node beyond its findings: written to the textfile as series
    (PRODUCTION.md, "serving-check"), for the alert rules and the dashboard. None: not established.

    Attributes:
        takes_calls: whether a caller would be served (``check/calls.py``).
        release: the active release's id (what ``releases/current`` points at).
        profile, vllm_release: the active release's profile name and vLLM release (its serving.json).
        switch_started_at: Unix seconds a switch in progress, or left unfinished, started
            (``switching.json``'s ``started_at``; its last change when that cannot be read).
    """

    __slots__ = ("takes_calls", "release", "profile", "vllm_release", "switch_started_at")

    def __init__(self) -> None:
        self.takes_calls: bool | None = None
        self.release: str | None = None
        self.profile: str | None = None
        self.vllm_release: str | None = None
        self.switch_started_at: float | None = None


class Report:
    """All findings of one run, the values reported as perfdata (name -> number), and the node's state."""

    __slots__ = ("node", "findings", "perfdata", "state")

    def __init__(self, node: str, findings: list[Finding], perfdata: dict[str, float] | None = None,
                 state: NodeState | None = None) -> None:
        self.node, self.findings, self.perfdata = node, findings, dict(perfdata or {})
        self.state = state or NodeState()

    @property
    def status(self) -> str:
        """The worst status among the findings."""
        return worst(f.status for f in self.findings)

    @property
    def exit_code(self) -> int:
        """The Nagios exit code of :attr:`status`."""
        return EXIT_CODES[self.status]

    def to_json(self) -> dict:
        """The report as a JSON-ready dict (``schema`` 1, described in PRODUCTION.md)."""
        return {"schema": 1, "node": self.node, "status": self.status, "exit_code": self.exit_code,
                "findings": [f.to_json() for f in self.findings], "perfdata": self.perfdata}

    @classmethod
    def from_json(cls, document: dict) -> "Report":
        """A report from :meth:`to_json`'s dict (as another node printed it).

        Raises:
            KeyError, TypeError, ValueError: not a report.
        """
        findings = [Finding.from_json(f) for f in document["findings"]]
        perf = {str(k): float(v) for k, v in dict(document.get("perfdata") or {}).items()}
        return cls(str(document["node"]), findings, perf)
