"""The canary analysis's pure core: engine scrapes, windows, measurements, and the analysis's result.

During a rollout the operator's side scrapes the canary's engine ``GET /metrics`` and a baseline node's (one
still on the old release) every ``interval_s``, ``count`` times, through the nodes. This module turns those
texts into what the rollout decides, with no I/O and no clock (every time is an argument, in seconds since the
Unix epoch), after docs/reference/canary-analysis.md:

- :func:`read_scrape`: one ``/metrics`` text at a time -> a :class:`Scrape` (vLLM's series summed over
  ``engine`` and ``model_name``), or a :class:`FailedScrape` saying why it could not be read;
- :func:`window`: the difference of two scrapes of one node (a counter reset, the engine restarting, handled
  as Prometheus' ``rate()`` handles one, and said);
- :func:`quantile`: a quantile from a histogram window, known only between two bucket bounds
  (:class:`Quantile`: both bounds and Prometheus' interpolated value, marked as such);
- :func:`measure`: one measurement's checks and verdict (pass, fail, inconclusive, error);
- :func:`assess`: the measurements so far -> the analysis's result (Argo Rollouts' semantics), and whether it
  can stop; :class:`AnalysisRun` keeps the scrapes and measurements of one analysis for the rollout's loop;
- the operator's lines (:meth:`Measurement.line`, :meth:`AnalysisResult.summary`) and the JSON-ready document
  (:meth:`AnalysisResult.document`);
- :func:`threshold_warnings`: a ``ttft_p95_max_s`` that no vLLM bucket bound equals can never be decided.

Names are vLLM 0.32.0's (:mod:`flatshare_ops.common.vllm_metrics`, docs/reference/vllm.md#metrics).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from enum import StrEnum
from fractions import Fraction
from typing import Any

from ..common import vllm_metrics as vm
from ..common.clock import utc_stamp
from ..common.protocol import AnalysisPhase
from ..common.text import one_line
from ..config.profile import Analysis as Settings
from .golden import GoldenCheck

#: The quantile the analysis judges (the profile's ``ttft_p95_max_s``).
Q = 0.95
#: The version of :meth:`AnalysisResult.document`'s shape.
SCHEMA = 1


class Verdict(StrEnum):
    """A check's or a measurement's verdict (Argo Rollouts' measurement phases, error for "not taken")."""

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    ERROR = "error"


#: How verdicts combine in one measurement: the worst wins (fail > error > inconclusive > pass).
_WORST = {Verdict.PASS: 0, Verdict.INCONCLUSIVE: 1, Verdict.ERROR: 2, Verdict.FAIL: 3}


class Action(StrEnum):
    """What the rollout does with an analysis: measure again, go on to the next batch, roll the canary back
    (and stop), or stop with the canary in place."""

    MEASURE = "measure"
    CONTINUE = "continue"
    ROLLBACK = "rollback"
    PAUSE = "pause"


class WindowError(ValueError):
    """Two scrapes that make no window (the end not after the start); :func:`measure` makes it an error."""


class _Unreadable(ValueError):
    """A ``/metrics`` text that cannot be read; :func:`read_scrape` makes it a :class:`FailedScrape`."""


# --- histograms and quantiles ----------------------------------------------


@dataclass(frozen=True)
class Histogram:
    """One histogram's cumulative bucket counts (Prometheus' ``_bucket`` series), summed over its series.

    Attributes:
        buckets: ``((upper bound in seconds, count of observations at most that bound), ...)``, sorted by
            bound, the last bound ``math.inf`` (``le="+Inf"``), counts whole and non-decreasing.
    """

    buckets: tuple[tuple[float, int], ...]

    @property
    def observations(self) -> int:
        """Every observation (the ``+Inf`` bucket's count)."""
        return self.buckets[-1][1]

    @property
    def bounds(self) -> tuple[float, ...]:
        return tuple(bound for bound, _ in self.buckets)

    def minus(self, earlier: Histogram) -> Histogram:
        """The observations made since ``earlier`` (same bounds; the caller checked that they are)."""
        return Histogram(tuple((bound, count - before) for (bound, count), (_, before)
                               in zip(self.buckets, earlier.buckets, strict=True)))


@dataclass(frozen=True)
class Quantile:
    """A quantile of a histogram window, as honest as its buckets.

    The ``ceil(q * observations)``-th smallest observation lies in ``(lower_s, upper_s]``, the bucket that holds
    it: that is all the buckets say. ``interpolated_s`` is what Prometheus' ``histogram_quantile`` computes
    (linear inside the bucket; the last finite bound in the ``+Inf`` bucket): an estimate, never a measurement.

    Attributes:
        q: the quantile (0.95).
        lower_s: the bucket's lower bound in seconds, exclusive (0 for the lowest bucket).
        upper_s: its upper bound in seconds, inclusive (``math.inf`` in the ``+Inf`` bucket).
        interpolated_s: histogram_quantile's value, seconds.
        observations: the window's observations.
    """

    q: float
    lower_s: float
    upper_s: float
    interpolated_s: float
    observations: int

    def text(self, what: str = "p95") -> str:
        """``0.25 < p95 <= 0.5 s (interpolated 0.41)``; the interpolated value to the bounds' own decimals."""
        if self.upper_s == math.inf:
            return f"{what} > {_figure(self.lower_s)} s (interpolated {_figure(self.interpolated_s)})"
        places = max(_places(self.lower_s), _places(self.upper_s))
        shown = f"{round(self.interpolated_s, places):.{places}f}"
        around = f"{what} <= " if self.lower_s == 0 else f"{_figure(self.lower_s)} < {what} <= "
        return f"{around}{_figure(self.upper_s)} s (interpolated {shown})"

    def cell(self) -> str:
        """The table's form: ``(0.25, 0.5] ~0.41``, ``> 2.5 ~2.5`` in the ``+Inf`` bucket (seconds)."""
        if self.upper_s == math.inf:
            return f"> {_figure(self.lower_s)} ~{_figure(self.interpolated_s)}"
        places = max(_places(self.lower_s), _places(self.upper_s))
        return f"({_figure(self.lower_s)}, {_figure(self.upper_s)}] ~{round(self.interpolated_s, places):.{places}f}"

    def document(self) -> dict[str, Any]:
        """JSON-ready: ``upper_s`` is null in the ``+Inf`` bucket (no upper bound)."""
        return {"q": self.q, "lower_s": self.lower_s,
                "upper_s": None if self.upper_s == math.inf else self.upper_s,
                "interpolated_s": self.interpolated_s, "observations": self.observations, "text": self.text()}


def quantile(q: float, histogram: Histogram) -> Quantile:
    """The ``q``-quantile of a histogram window: its bucket's bounds and Prometheus' interpolated value.

    Prometheus' ``histogram_quantile`` (promql/quantile.go, ``bucketQuantile``): rank = q x observations; the
    bucket is the first whose cumulative count is at least the rank; inside it the value is interpolated
    linearly from its lower bound (0 below the lowest bucket), except in the ``+Inf`` bucket, where it is the
    highest finite bound. Computed in the same order of operations, so the value is Prometheus' to the bit.

    Args:
        q: the quantile, 0 < q <= 1.
        histogram: a window (cumulative counts, non-decreasing, ending with ``+Inf``).

    Raises:
        ValueError: the histogram has no observations (no quantile exists), or ``q`` is out of range.
    """
    if not 0 < q <= 1:
        raise ValueError(f"a quantile is in (0, 1], got {q}")
    buckets = histogram.buckets
    if histogram.observations == 0:
        raise ValueError("no observations: no quantile")
    rank = q * histogram.observations
    b = next((i for i in range(len(buckets) - 1) if buckets[i][1] >= rank), len(buckets) - 1)
    if b == len(buckets) - 1:
        highest = buckets[-2][0]
        return Quantile(q, highest, math.inf, highest, histogram.observations)
    end, count = buckets[b]
    start = 0.0
    if b > 0:
        start = buckets[b - 1][0]
        count -= buckets[b - 1][1]
        rank -= buckets[b - 1][1]
    return Quantile(q, start, end, start + (end - start) * (rank / count), histogram.observations)


# --- scrapes ---------------------------------------------------------------

#: A series' identity: (sample name, its labels sorted).
SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class Scrape:
    """One node's ``/metrics``, read at a time: vLLM's series the analysis uses, summed over engines and models.

    Attributes:
        node: the node's inventory name.
        at: when it was taken, seconds since the Unix epoch.
        ttft: ``vllm:time_to_first_token_seconds`` (cumulative since the engine started).
        e2e: ``vllm:e2e_request_latency_seconds``.
        finished: ``vllm:request_success_total`` by ``finished_reason`` (counts since the engine started).
        waiting: ``vllm:num_requests_waiting`` (a gauge, requests).
        counters: every counter series above, by name and labels: a reset shows in one of them.
        created: the ``_created`` timestamp of each series that serves one (prometheus_client does): a new one
            means the series started again.
    """

    node: str
    at: float
    ttft: Histogram
    e2e: Histogram
    finished: Mapping[str, int]
    waiting: float
    counters: Mapping[SeriesKey, int] = field(repr=False)
    created: Mapping[SeriesKey, float] = field(repr=False)


@dataclass(frozen=True)
class FailedScrape:
    """A scrape that could not be read: empty, malformed, without vLLM's series, or not taken at all (the
    rollout makes one for a node that did not answer, with its own reason)."""

    node: str
    at: float
    reason: str


ScrapeResult = Scrape | FailedScrape


def read_scrape(node: str, at: float, text: str) -> ScrapeResult:
    """Read one ``/metrics`` text (Prometheus' text format, parsed by prometheus_client's parser).

    Args:
        node: the node it came from.
        at: when it was taken, seconds since the Unix epoch.
        text: the body of the engine's ``GET /metrics``.

    Returns:
        A :class:`Scrape`, or a :class:`FailedScrape` whose reason names what is wrong: empty, not Prometheus
        text (the parser's words), a series vLLM 0.32.0 serves missing, or counts that are no counts.
    """
    try:
        return _read(node, at, text)
    except _Unreadable as err:
        return FailedScrape(node, at, str(err))


_REQUIRED = (f"{vm.TIME_TO_FIRST_TOKEN}_bucket", f"{vm.E2E_REQUEST_LATENCY}_bucket", vm.REQUEST_SUCCESS,
             vm.REQUESTS_WAITING)


def _read(node: str, at: float, text: str) -> Scrape:
    if not text.strip():
        raise _Unreadable("/metrics is empty")
    try:
        samples = vm.read_samples(text)
    except ValueError as err:
        raise _Unreadable(f"/metrics is not Prometheus text: {_short(err)}") from None
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    seen: set[SeriesKey] = set()
    for name, labels, value in samples:
        key = (name, tuple(sorted(labels.items())))
        if key in seen:
            raise _Unreadable(f"/metrics serves the series {_series_text(key)} twice")
        seen.add(key)
        by_name.setdefault(name, []).append((labels, value))
    missing = [name for name in _REQUIRED if not by_name.get(name)]
    if missing:
        raise _Unreadable(f"/metrics has no {' and no '.join(missing)} series ({len(seen)} series read): "
                          "not vLLM 0.32.0's engine metrics")
    counters: dict[SeriesKey, int] = {}
    ttft = _histogram(by_name, vm.TIME_TO_FIRST_TOKEN, counters)
    e2e = _histogram(by_name, vm.E2E_REQUEST_LATENCY, counters)
    finished: dict[str, int] = {}
    for labels, value in by_name[vm.REQUEST_SUCCESS]:
        reason = labels.get("finished_reason")
        if reason is None:
            raise _Unreadable(f"{vm.REQUEST_SUCCESS} has a series without a finished_reason label")
        count = _whole(value, vm.REQUEST_SUCCESS)
        counters[(vm.REQUEST_SUCCESS, tuple(sorted(labels.items())))] = count
        finished[reason] = finished.get(reason, 0) + count
    waiting = 0.0
    for _labels, value in by_name[vm.REQUESTS_WAITING]:
        if not math.isfinite(value) or value < 0:
            raise _Unreadable(f"{vm.REQUESTS_WAITING} is {value}, not a number of requests")
        waiting += value
    created = {(name, tuple(sorted(labels.items()))): value
               for name in (f"{vm.TIME_TO_FIRST_TOKEN}_created", f"{vm.E2E_REQUEST_LATENCY}_created",
                            vm.REQUEST_SUCCESS.removesuffix("_total") + "_created")
               for labels, value in by_name.get(name, ())}
    for key, value in created.items():  # a time since the epoch: a NaN would differ from itself, a restart each window
        if not math.isfinite(value) or value < 0:
            raise _Unreadable(f"{_series_text(key)} is {value}, not a time")
    return Scrape(node, at, ttft, e2e, finished, waiting, counters, created)


#: The most buckets a histogram is read with: vLLM's have a few dozen at most (common/vllm_metrics.py); each window
#: of an analysis keeps its time-to-first-token buckets in the record, which must stay small (node/records.py).
MAX_BUCKETS = 100


def _histogram(by_name: Mapping[str, list[tuple[dict[str, str], float]]], name: str,
               counters: dict[SeriesKey, int]) -> Histogram:
    """A histogram's ``_bucket`` series summed over their labels (every series with the same bounds)."""
    per_series: dict[tuple[tuple[str, str], ...], dict[float, int]] = {}
    for labels, value in by_name[f"{name}_bucket"]:
        le = labels.get("le")
        try:
            bound = float(le) if le is not None else math.nan
        except ValueError:
            bound = math.nan
        # A bound is a latency in seconds: finite and not negative, or +Inf (the last bucket). NaN, -Inf and a
        # negative bound are no bucket bounds (a p95 "<= -1 s" read from them would pass any threshold).
        if math.isnan(bound) or bound < 0:
            raise _Unreadable(f"{name}_bucket has a series without an le label" if le is None
                              else f"{name}_bucket has a series whose le is {one_line(le)!r}, not a bucket bound")
        count = _whole(value, f"{name}_bucket")
        counters[(f"{name}_bucket", tuple(sorted(labels.items())))] = count
        rest = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        per_series.setdefault(rest, {})[bound] = count
    bounds = {tuple(sorted(series)) for series in per_series.values()}
    if len(bounds) > 1:
        raise _Unreadable(f"{name}'s series have different buckets")
    (only,) = bounds
    if len(only) > MAX_BUCKETS:
        raise _Unreadable(f"{name} has {len(only)} buckets, more than the {MAX_BUCKETS} a histogram is read with "
                          f"(vLLM 0.32.0's has {len(vm.TIME_TO_FIRST_TOKEN_BUCKETS) + 1} for time to first token)")
    if only[-1] != math.inf or len(only) < 2:
        raise _Unreadable(f"{name} has no +Inf bucket" if only[-1] != math.inf else f"{name} has no finite bucket")
    summed = tuple((bound, sum(series[bound] for series in per_series.values())) for bound in only)
    for (low, below), (high, above) in zip(summed, summed[1:]):
        if above < below:
            raise _Unreadable(f"{name}'s bucket counts fall from {below} (le {_figure(low)}) to {above} "
                              f"(le {_le(high)}): not a cumulative histogram")
    return Histogram(summed)


def _whole(value: float, name: str) -> int:
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise _Unreadable(f"{name} has the value {value}, not a count")
    return int(value)


# --- windows ---------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """What one node's engine did between two scrapes.

    Attributes:
        node: the node.
        start, end: the scrapes' times, seconds since the Unix epoch.
        ttft, e2e: the histograms' observations made in the window.
        finished: requests that finished in the window, by ``finished_reason``.
        waiting: ``vllm:num_requests_waiting`` at the end.
        engine_restarted: a counter went backwards or started again (the engine restarted): the counts are
            those since its start, as Prometheus counts a reset.
    """

    node: str
    start: float
    end: float
    ttft: Histogram
    e2e: Histogram
    finished: Mapping[str, int]
    waiting: float
    engine_restarted: bool

    @property
    def requests(self) -> int:
        """Requests that finished in the window, for whatever reason."""
        return sum(self.finished.values())

    @property
    def errors(self) -> int:
        """Requests that ended in error or abort."""
        return sum(self.finished.get(reason, 0) for reason in vm.ERROR_REASONS)

    @property
    def first_tokens(self) -> int:
        """Requests whose first token came in the window (the TTFT histogram's observations)."""
        return self.ttft.observations

    def error_share(self) -> Fraction:
        """Errors and aborts over finished requests, exact. Raises ZeroDivisionError with no requests."""
        return Fraction(self.errors, self.requests)

    def p95(self) -> Quantile:
        """The TTFT p95. Raises ValueError with no first token in the window."""
        return quantile(Q, self.ttft)

    def document(self) -> dict[str, Any]:
        """JSON-ready; ``error_share`` and the quantiles are null when the window has no request for them."""
        return {
            "node": self.node, "start": utc_stamp(self.start), "end": utc_stamp(self.end),
            "start_s": self.start, "end_s": self.end, "engine_restarted": self.engine_restarted,
            "requests": self.requests, "finished": dict(sorted(self.finished.items())), "errors": self.errors,
            "error_share": float(self.error_share()) if self.requests else None,
            "first_tokens": self.first_tokens, "waiting": self.waiting,
            "ttft_p95": self.p95().document() if self.first_tokens else None,
            "e2e_p95": quantile(Q, self.e2e).document() if self.e2e.observations else None,
            "ttft_buckets": {_le(bound): count for bound, count in self.ttft.buckets},
        }

    def text(self) -> str:
        """``cyan: 0.25 < TTFT p95 <= 0.5 s (interpolated 0.41), 40 requests, 1 error or abort (2.5%)``."""
        ttft = self.p95().text("TTFT p95") if self.first_tokens else "no first token"
        errors = f"{self.errors} {'error or abort' if self.errors == 1 else 'errors or aborts'}"
        share = f" ({_percent(self.error_share())})" if self.requests else ""
        restarted = ", the engine restarted in the window (counts since its start)" if self.engine_restarted else ""
        return f"{self.node}: {ttft}, {self.requests} requests, {errors}{share}{restarted}"


@dataclass(frozen=True)
class MissingWindow:
    """A window that could not be measured, and why."""

    node: str
    start: float
    end: float
    reason: str

    def document(self) -> dict[str, Any]:
        return {"node": self.node, "start": utc_stamp(self.start), "end": utc_stamp(self.end),
                "start_s": self.start, "end_s": self.end, "error": self.reason}

    def text(self) -> str:
        return f"{self.node}: not measured: {self.reason}"


def window(start: Scrape, end: Scrape) -> Window:
    """The difference of two scrapes of one node.

    A counter that went backwards, a series that vanished, a ``_created`` that changed or buckets that changed
    mean the engine restarted: Prometheus' ``rate()`` takes a counter that fell as reset to 0 and counts its new value
    (docs/reference/canary-analysis.md#windows). A restart resets every series at once, and a series can
    already count more than before its reset, so one reset found is taken as a reset of all: the window's
    counts are then the end scrape's, and :attr:`Window.engine_restarted` says so.

    Raises:
        ValueError: the scrapes are of two nodes (a bug of the caller).
        WindowError: the end scrape is not after the start.
    """
    if start.node != end.node:
        raise ValueError(f"a window is of one node, got scrapes of {start.node} and {end.node}")
    if not end.at > start.at:
        raise WindowError(f"the window's end ({utc_stamp(end.at)}) is not after its start ({utc_stamp(start.at)})")
    restarted = (any(key not in end.counters or end.counters[key] < value for key, value in start.counters.items())
                 or any(end.created.get(key, value) != value for key, value in start.created.items())
                 or end.ttft.bounds != start.ttft.bounds or end.e2e.bounds != start.e2e.bounds)
    if restarted:
        ttft, e2e, finished = end.ttft, end.e2e, dict(end.finished)
    else:
        ttft, e2e = end.ttft.minus(start.ttft), end.e2e.minus(start.e2e)
        finished = {reason: count - start.finished.get(reason, 0) for reason, count in end.finished.items()}
    return Window(end.node, start.at, end.at, ttft, e2e, finished, end.waiting, restarted)


def _window_of(pair: tuple[ScrapeResult, ScrapeResult]) -> Window | MissingWindow:
    start, end = pair
    if isinstance(end, FailedScrape):
        return MissingWindow(end.node, start.at, end.at, end.reason)
    if isinstance(start, FailedScrape):
        return MissingWindow(end.node, start.at, end.at, f"the scrape the window starts from: {start.reason}")
    try:
        return window(start, end)
    except WindowError as err:
        return MissingWindow(end.node, start.at, end.at, str(err))


# --- one measurement -------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One rule's verdict in a measurement, and why (a sentence with the figures it was decided on)."""

    rule: str
    verdict: Verdict
    reason: str

    def document(self) -> dict[str, str]:
        return {"rule": self.rule, "verdict": str(self.verdict), "reason": self.reason}


@dataclass(frozen=True)
class Measurement:
    """One measurement of the canary (and the baseline over the same interval), its checks and its verdict.

    Attributes:
        number: 1 for the first measurement.
        count: the analysis's ``count``.
        canary: the canary's window, or why it could not be measured.
        baseline: the baseline's, or why not; None when the rollout has no node on the old release.
        checks: each rule's verdict, in order: ``min_requests``, ``ttft_p95_max_s``, ``error_share_max``,
            ``baseline`` (a canary not measured: one ``canary`` check, an error).
        verdict: the worst of the checks' (fail > error > inconclusive > pass).
    """

    number: int
    count: int
    canary: Window | MissingWindow
    baseline: Window | MissingWindow | None
    checks: tuple[Check, ...]
    verdict: Verdict

    @property
    def reasons(self) -> tuple[str, ...]:
        """Why the verdict: the reasons of the checks that gave it."""
        return tuple(c.reason for c in self.checks if c.verdict == self.verdict)

    def row(self) -> str:
        """The measurement as a row of :func:`table_header`'s table: number, canary, window, verdict, the canary's
        TTFT p95 bucket, finished requests and errors, the baseline's TTFT p95, and why (the reasons of the
        checks that gave a verdict other than pass, an engine restart in either window)."""
        why = ["every check passed"] if self.verdict == Verdict.PASS else list(self.reasons)
        window: object  # each measured window, then the canary's times as text
        for window in (self.canary, self.baseline):
            if isinstance(window, Window) and window.engine_restarted:
                why.append(f"{window.node}: the engine restarted in the window (counts since its start)")
        if isinstance(self.canary, Window):
            errors = f"{self.canary.errors}" + (f" ({_percent(self.canary.error_share())})" if self.canary.requests
                                                else "")
            cells = (_p95_cell(self.canary), str(self.canary.requests), errors)
        else:
            cells = ("not measured", "-", "-")
        baseline = ("none" if self.baseline is None else _p95_cell(self.baseline)
                    if isinstance(self.baseline, Window) else "not measured")
        window = f"{_clock(self.canary.start)[:-1]}-{_clock(self.canary.end)}"
        return _ROW.format(f"{self.number}/{self.count}", self.canary.node, window, str(self.verdict), *cells,
                           baseline, "; ".join(why))

    def line(self) -> str:
        """The operator's line: the window, the verdict and why, the canary's and the baseline's values."""
        span = f"{_clock(self.canary.start)}-{_clock(self.canary.end)}"
        baseline = ("baseline: none (no node on the old release)" if self.baseline is None
                    else f"baseline {self.baseline.text()}")
        return (f"measurement {self.number} of {self.count}, {span}: {self.verdict} ({'; '.join(self.reasons)})"
                f" | canary {self.canary.text()} | {baseline}")

    def document(self) -> dict[str, Any]:
        return {"number": self.number, "count": self.count, "verdict": str(self.verdict),
                "reasons": list(self.reasons), "checks": [c.document() for c in self.checks],
                "canary": self.canary.document(),
                "baseline": None if self.baseline is None else self.baseline.document(), "line": self.line(),
                "row": self.row()}


#: The canary analysis's table, one row a measurement (:meth:`Measurement.row`).
_ROW = "  {:<5} {:<10} {:<18} {:<12} {:<20} {:>8} {:<12} {:<20} {}"


def table_header() -> str:
    """The header of the measurements' table; TTFT p95 cells are the bucket that holds it, in seconds, and
    Prometheus' interpolated value after ``~``."""
    return _ROW.format("#", "canary", "window", "verdict", "TTFT p95 (s)", "requests", "errors",
                       "baseline p95 (s)", "why").rstrip()


def _p95_cell(window: Window) -> str:
    return window.p95().cell() if window.first_tokens else "no first token"


def measure(number: int, settings: Settings, canary: tuple[ScrapeResult, ScrapeResult],
            baseline: tuple[ScrapeResult, ScrapeResult] | None) -> Measurement:
    """Judge one measurement: the canary's window against the profile's thresholds and against the baseline's.

    The rules (docs/reference/canary-analysis.md#one-measurement):

    - ``min_requests``: the canary's window needs at least ``min_requests`` finished requests and as many first
      tokens; with fewer, the measurement is inconclusive and no other rule is judged (low traffic is neither a
      pass nor a failure).
    - ``ttft_p95_max_s``: the canary's TTFT p95 lies in ``(lower, upper]``; it passes only when ``upper`` is at
      most the threshold, fails only when ``lower`` is at or above it (then the p95 is above it), and a
      threshold inside the bucket is stated as such: inconclusive.
    - ``error_share_max``: requests ending in ``error`` or ``abort`` over finished requests, exact (counts),
      at most the threshold.
    - ``baseline``: canary p95 <= ``baseline_factor`` x baseline p95 + ``baseline_margin_s``, interval against
      interval: with the baseline's p95 in ``(bl, bu]`` the limit lies in ``(f*bl + m, f*bu + m]``; pass when
      the canary's upper bound is at most the limit's lower end, fail when the canary's lower bound is at or
      above the limit's upper end, else inconclusive. A baseline with fewer than ``min_requests`` first tokens
      is inconclusive, and so is one that could not be measured (the canary's own rules still judge: a baseline
      that stopped answering never rolls back a healthy canary); no baseline node at all: no such check.

    The fixed threshold and the baseline both count: the measurement's verdict is the worst of its checks'
    (fail > error > inconclusive > pass), so it fails when any rule fails, passes only when every rule passes,
    and is otherwise inconclusive (or an error when a needed window could not be measured). Comparisons are
    exact: the profile's values and the bucket bounds are taken as the decimals they are written as.

    Args:
        number: the measurement's number (1 for the first).
        settings: the profile's ``[release.analysis]``.
        canary: the canary's (start, end) scrapes; baseline: the baseline's, or None when no node is on the
            old release.

    Raises:
        ValueError: a pair's scrapes are of two nodes (a bug of the caller).
    """
    canary_window = _window_of(canary)
    baseline_window = None if baseline is None else _window_of(baseline)
    checks = _checks(settings, canary_window, baseline_window)
    verdict = max((c.verdict for c in checks), key=_WORST.__getitem__)
    return Measurement(number, settings.count, canary_window, baseline_window, checks, verdict)


def _checks(settings: Settings, canary: Window | MissingWindow,
            baseline: Window | MissingWindow | None) -> tuple[Check, ...]:
    if isinstance(canary, MissingWindow):
        return (Check("canary", Verdict.ERROR, f"canary {canary.node} not measured: {canary.reason}"),)
    least = settings.min_requests
    if canary.requests < least or canary.first_tokens < least:
        return (Check("min_requests", Verdict.INCONCLUSIVE,
                      f"{canary.requests} requests finished and {canary.first_tokens} first tokens, fewer than "
                      f"min_requests {least}: too few to judge"),)
    checks = [Check("min_requests", Verdict.PASS,
                    f"{canary.requests} requests, {canary.first_tokens} first tokens (min_requests {least})"),
              _threshold_check(settings, canary.p95()),
              _error_check(settings, canary)]
    if baseline is not None:
        checks.append(_baseline_check(settings, canary.p95(), baseline))
    return tuple(checks)


def _threshold_check(settings: Settings, p95: Quantile) -> Check:
    limit, lower, upper = _exact(settings.ttft_p95_max_s), _exact(p95.lower_s), _exact(p95.upper_s)
    named = f"ttft_p95_max_s {_figure(settings.ttft_p95_max_s)}"
    if upper <= limit:
        return Check("ttft_p95_max_s", Verdict.PASS, f"TTFT p95 <= {_figure(p95.upper_s)} s, within {named}")
    if lower >= limit:
        return Check("ttft_p95_max_s", Verdict.FAIL, f"TTFT p95 > {_figure(p95.lower_s)} s, over {named}")
    return Check("ttft_p95_max_s", Verdict.INCONCLUSIVE,
                 f"{named} lies inside the TTFT p95's bucket {_interval(p95.lower_s, p95.upper_s)}: undecided")


def _error_check(settings: Settings, canary: Window) -> Check:
    share, limit = canary.error_share(), _exact(settings.error_share_max)
    said = (f"{canary.errors} of {canary.requests} requests ended in error or abort ({_percent(share)}), "
            f"{'within' if share <= limit else 'over'} error_share_max {_percent(limit)}")
    return Check("error_share_max", Verdict.PASS if share <= limit else Verdict.FAIL, said)


def _baseline_check(settings: Settings, canary: Quantile, baseline: Window | MissingWindow) -> Check:
    if isinstance(baseline, MissingWindow):
        # The canary was measured; only the comparison is missing. An error here would let a baseline node that
        # stopped answering (drained, down, its network cut) roll back a healthy canary after
        # consecutive_error_limit measurements: the same missing comparison as a quiet baseline, inconclusive.
        return Check("baseline", Verdict.INCONCLUSIVE,
                     f"baseline {baseline.node} not measured: {baseline.reason}: no comparison")
    if baseline.first_tokens < settings.min_requests:
        return Check("baseline", Verdict.INCONCLUSIVE,
                     f"baseline {baseline.node} had {baseline.first_tokens} first tokens, fewer than "
                     f"min_requests {settings.min_requests}: no comparison")
    base = baseline.p95()
    factor, margin = _exact(settings.baseline_factor), _exact(settings.baseline_margin_s)
    low, high = factor * _exact(base.lower_s) + margin, factor * _exact(base.upper_s) + margin
    rule = (f"{_figure(settings.baseline_factor)} x baseline p95 + {_figure(settings.baseline_margin_s)} s "
            f"{_interval(low, high)}")
    if _exact(canary.upper_s) <= low:
        return Check("baseline", Verdict.PASS, f"canary TTFT p95 <= {_figure(canary.upper_s)} s, within {rule}")
    if _exact(canary.lower_s) >= high:
        return Check("baseline", Verdict.FAIL, f"canary TTFT p95 > {_figure(canary.lower_s)} s, over {rule}")
    return Check("baseline", Verdict.INCONCLUSIVE,
                 f"canary TTFT p95 {_interval(canary.lower_s, canary.upper_s)} against {rule}: undecided")


# --- the analysis ----------------------------------------------------------


@dataclass(frozen=True)
class AnalysisResult:
    """Where an analysis stands after its measurements so far, and what the rollout does.

    Attributes:
        canary, baseline: the nodes (baseline None: no node on the old release).
        settings: the profile's ``[release.analysis]``.
        dry_run: ``--analysis dry-run``: everything is computed, nothing acted on.
        measurements: in order.
        phase: running, or the outcome.
        action: what the analysis decides (in a dry run, what it would have done).
        done: no more measurements are needed (a failure stops early; a dry run measures all ``count``).
        reason: why the phase, one sentence.
        golden: the golden answers' check (:mod:`.golden`), None when the profile names no prompts.
    """

    canary: str
    baseline: str | None
    settings: Settings
    dry_run: bool
    measurements: tuple[Measurement, ...]
    phase: AnalysisPhase
    action: Action
    done: bool
    reason: str
    golden: GoldenCheck | None = None

    @property
    def tally(self) -> dict[str, int]:
        """Measurements by verdict (every verdict, 0 included)."""
        return {str(v): sum(1 for m in self.measurements if m.verdict == v) for v in Verdict}

    @property
    def rollout_action(self) -> Action:
        """What the rollout does now: :attr:`action`, except in a dry run, which measures to the end and goes on."""
        if not self.dry_run:
            return self.action
        return Action.CONTINUE if self.done else Action.MEASURE

    def summary(self) -> str:
        """The analysis's one line: the outcome, why, and what the rollout does (or, in a dry run, would do)."""
        who = f"canary {self.canary}" + (f" against baseline {self.baseline}" if self.baseline else "")
        tally = ", ".join(f"{self.tally[v]} {word}" for v, word in _TALLY_WORDS.items())
        head = f"analysis of {who}: {self.phase}, {len(self.measurements)} of {self.settings.count} measurements " \
               f"({tally})"
        if self.phase == AnalysisPhase.RUNNING:
            return f"{'dry run: ' if self.dry_run else ''}{head}: measuring"
        if self.dry_run:
            then = "goes on" if self.done else "measures on"
            return f"dry run: {head}: {self.reason}; it would {_WOULD[self.action]}; nothing acted on, the rollout {then}"
        return f"{head}: {self.reason}; {_DOES[self.action]}"

    def document(self) -> dict[str, Any]:
        """The whole analysis, JSON-ready (``json.dumps`` takes it as is), for the history record and ``--json``.

        Shape (schema 1)::

            {"schema": 1, "canary": NODE, "baseline": NODE or null, "dry_run": bool,
             "settings": {the profile's [release.analysis]},
             "phase": "running|passed|failed|inconclusive", "action": "measure|continue|rollback|pause",
             "rollout_action": ..., "done": bool, "reason": TEXT, "summary": TEXT,
             "tally": {"pass": N, "fail": N, "inconclusive": N, "error": N},
             "measurements": [{"number", "count", "verdict", "reasons", "checks": [{"rule", "verdict", "reason"}],
                               "canary": WINDOW, "baseline": WINDOW or null, "line", "row"}],
             "golden": GOLDEN or null}

        A WINDOW is ``{"node", "start", "end" (UTC stamps), "start_s", "end_s" (Unix seconds),
        "engine_restarted", "requests", "finished" {reason: N}, "errors", "error_share" (null: no request),
        "first_tokens", "waiting", "ttft_p95", "e2e_p95" (QUANTILE or null: no observation), "ttft_buckets"
        {le: cumulative count}}``, or ``{"node", "start", "end", "start_s", "end_s", "error": TEXT}`` when it could
        not be measured. A QUANTILE is ``{"q", "lower_s", "upper_s" (null: the +Inf bucket), "interpolated_s",
        "observations", "text"}``. GOLDEN is :meth:`.golden.GoldenCheck.document`.
        """
        return {"schema": SCHEMA, "canary": self.canary, "baseline": self.baseline, "dry_run": self.dry_run,
                "settings": self.settings.model_dump(), "phase": str(self.phase), "action": str(self.action),
                "rollout_action": str(self.rollout_action), "done": self.done, "reason": self.reason,
                "summary": self.summary(), "tally": self.tally,
                "measurements": [m.document() for m in self.measurements],
                "golden": None if self.golden is None else self.golden.document()}


_TALLY_WORDS = {Verdict.PASS: "passed", Verdict.FAIL: "failed", Verdict.INCONCLUSIVE: "inconclusive",
                Verdict.ERROR: "not taken"}
_DOES = {Action.CONTINUE: "the rollout goes on", Action.ROLLBACK: "the canary rolls back and the rollout stops",
         Action.PAUSE: "the rollout stops with the canary in place", Action.MEASURE: "measuring"}
_WOULD = {Action.CONTINUE: "go on", Action.ROLLBACK: "roll the canary back and stop the rollout",
          Action.PAUSE: "stop the rollout with the canary in place", Action.MEASURE: "measure on"}
_INCONCLUSIVE_DOES = {"fail": Action.ROLLBACK, "pause": Action.PAUSE, "pass": Action.CONTINUE}


def assess(measurements: Sequence[Measurement], settings: Settings, *, canary: str, baseline: str | None,
           dry_run: bool = False, golden: GoldenCheck | None = None) -> AnalysisResult:
    """The analysis's result after ``measurements`` (in order), with Argo Rollouts' semantics.

    (docs/reference/canary-analysis.md#the-analysis.) Failed once more than ``failure_limit`` measurements
    failed, or once ``consecutive_error_limit`` measurements in a row could not be taken (Argo errors the
    analysis only when the streak *exceeds* its limit; here reaching it fails). After ``count`` measurements:
    passed when at most ``inconclusive_limit`` of them neither passed nor failed (inconclusive or error), else
    inconclusive, which the profile's ``inconclusive`` turns into a rollback (``fail``), a pause or going on
    (``pass``). Unlike Argo, a measurement that could not be taken counts toward ``count``: the analysis lasts
    ``count`` intervals at most, and what it could not see makes it inconclusive, never a pass; an analysis
    none of whose ``count`` measurements could be taken fails (``consecutive_error_limit`` above ``count``).

    It is done early when the action can no longer change: failed, or inconclusive beyond the limit when the
    profile turns inconclusive into a failure. A dry run computes the same phase and action but measures all
    ``count`` and acts on nothing (:attr:`AnalysisResult.rollout_action`).

    Golden answers that differ (``golden``, :attr:`.golden.GoldenCheck.failed`) fail the analysis before any
    measurement decides, whatever the measurements say.

    Raises:
        ValueError: more measurements than ``count`` (a bug of the caller).
    """
    taken = len(measurements)
    if taken > settings.count:
        raise ValueError(f"{taken} measurements, more than count {settings.count}")
    verdicts = [m.verdict for m in measurements]
    failed = verdicts.count(Verdict.FAIL)
    unclear = taken - failed - verdicts.count(Verdict.PASS)
    streak = _longest_run(verdicts, Verdict.ERROR)
    finished = taken == settings.count
    if golden is not None and golden.failed:
        phase, action, early = AnalysisPhase.FAILED, Action.ROLLBACK, True
        reason = golden.reason()
    elif failed > settings.failure_limit:
        phase, action, early = AnalysisPhase.FAILED, Action.ROLLBACK, True
        reason = f"{failed} measurements failed, more than failure_limit {settings.failure_limit}"
    elif streak >= settings.consecutive_error_limit:
        phase, action, early = AnalysisPhase.FAILED, Action.ROLLBACK, True
        reason = (f"{streak} measurements in a row could not be taken "
                  f"(consecutive_error_limit {settings.consecutive_error_limit})")
    elif finished and streak == taken:
        # consecutive_error_limit above count: not one measurement could be taken. What the analysis never saw
        # fails it, whatever ``inconclusive`` says (a canary whose metrics never read would otherwise pass).
        phase, action, early = AnalysisPhase.FAILED, Action.ROLLBACK, True
        reason = (f"none of the {taken} measurements could be taken (consecutive_error_limit "
                  f"{settings.consecutive_error_limit} is above count {settings.count})")
    elif unclear > settings.inconclusive_limit and (finished or settings.inconclusive == "fail"):
        phase, action = AnalysisPhase.INCONCLUSIVE, _INCONCLUSIVE_DOES[settings.inconclusive]
        early = settings.inconclusive == "fail"
        reason = (f"{unclear} measurements neither passed nor failed, more than inconclusive_limit "
                  f"{settings.inconclusive_limit}; inconclusive = \"{settings.inconclusive}\"")
    elif finished:
        phase, action, early = AnalysisPhase.PASSED, Action.CONTINUE, True
        reason = (f"{failed} failed (failure_limit {settings.failure_limit}), {unclear} neither passed nor failed "
                  f"(inconclusive_limit {settings.inconclusive_limit})")
    else:
        phase, action, early = AnalysisPhase.RUNNING, Action.MEASURE, False
        reason = f"{settings.count - taken} measurements to go"
    done = finished if dry_run else (early or finished)
    return AnalysisResult(canary, baseline, settings, dry_run, tuple(measurements), phase, action, done, reason,
                          golden)


def _longest_run(verdicts: Sequence[Verdict], verdict: Verdict) -> int:
    longest = run = 0
    for v in verdicts:
        run = run + 1 if v == verdict else 0
        longest = max(longest, run)
    return longest


@dataclass(frozen=True)
class AnalysisRun:
    """One analysis in progress, for the rollout's loop (immutable: :meth:`record` returns the next state).

    The rollout scrapes the canary and the baseline, calls :meth:`record` (the first call only starts the first
    window), prints the new :attr:`measurements`' lines, and stops when :attr:`result` is done, acting on its
    :attr:`AnalysisResult.rollout_action`. A node's window starts at its latest readable scrape, so one scrape
    that failed costs one measurement (its window then covers the intervals since, and says so in its times).
    """

    settings: Settings
    canary: str
    baseline: str | None
    dry_run: bool = False
    canary_scrapes: tuple[ScrapeResult, ...] = ()
    baseline_scrapes: tuple[ScrapeResult, ...] = ()
    measurements: tuple[Measurement, ...] = ()
    golden: GoldenCheck | None = None

    def record(self, canary: ScrapeResult, baseline: ScrapeResult | None = None) -> AnalysisRun:
        """The state after one more pair of scrapes (``baseline`` None exactly when the run has no baseline).

        Raises:
            ValueError: the analysis is already done, or a scrape is of the wrong node.
        """
        if self.result.done:
            raise ValueError("the analysis is done: no more scrapes")
        if canary.node != self.canary or (baseline is None) != (self.baseline is None) or (
                baseline is not None and baseline.node != self.baseline):
            raise ValueError(f"scrapes of {canary.node} and {baseline.node if baseline else 'no baseline'} in the "
                             f"analysis of {self.canary} against {self.baseline or 'no baseline'}")
        canary_scrapes = (*self.canary_scrapes, canary)
        baseline_scrapes = (*self.baseline_scrapes, baseline) if baseline is not None else ()
        measurements = self.measurements
        if len(canary_scrapes) > 1:
            pair = (_start(self.canary_scrapes), canary)
            base = (_start(self.baseline_scrapes), baseline) if baseline is not None else None
            measurements = (*measurements, measure(len(measurements) + 1, self.settings, pair, base))
        return AnalysisRun(self.settings, self.canary, self.baseline, self.dry_run, canary_scrapes,
                           baseline_scrapes, measurements, self.golden)

    @property
    def result(self) -> AnalysisResult:
        return assess(self.measurements, self.settings, canary=self.canary, baseline=self.baseline,
                      dry_run=self.dry_run, golden=self.golden)


def _start(scrapes: Sequence[ScrapeResult]) -> ScrapeResult:
    """Where a node's next window starts: its latest readable scrape, else its latest (failed) one."""
    return next((s for s in reversed(scrapes) if isinstance(s, Scrape)), scrapes[-1])


# --- the profile's threshold -----------------------------------------------


def threshold_warnings(settings: Settings) -> list[str]:
    """One line per threshold the analysis can never decide: ``ttft_p95_max_s`` not one of vLLM 0.32.0's TTFT
    bucket bounds (docs/reference/vllm.md#metrics) leaves every p95 in the bucket around it inconclusive.

    ``flatshare profiles verify`` prints them as warnings.
    """
    limit = settings.ttft_p95_max_s
    bounds = vm.TIME_TO_FIRST_TOKEN_BUCKETS
    if limit in bounds:
        return []
    below = max((b for b in bounds if b < limit), default=0.0)
    above = min((b for b in bounds if b > limit), default=math.inf)
    use = " or ".join(_figure(b) for b in (below, above) if 0 < b < math.inf)
    return [f"release.analysis.ttft_p95_max_s {_figure(limit)} is not one of vLLM 0.32.0's "
            f"{vm.TIME_TO_FIRST_TOKEN} bucket bounds: a p95 in the bucket {_interval(below, above)} can never be "
            f"decided against it (inconclusive); use {use}"]


# --- figures ---------------------------------------------------------------


def _exact(value: float) -> Fraction | float:
    """A float as the decimal it was written as (its shortest repr): 0.1 is 1/10, not the binary double.
    ``math.inf`` (the ``+Inf`` bucket's bound) stays itself: it compares and multiplies with fractions."""
    return value if value == math.inf else Fraction(repr(value))


def _figure(value: float | Fraction) -> str:
    """A bound or a setting as its decimal, no exponent and no trailing zeros: 0.25, 2560, 0.475."""
    if isinstance(value, Fraction):
        number = Decimal(value.numerator) / Decimal(value.denominator)
    else:
        number = Decimal(repr(value))
    text = format(number.normalize(), "f")
    return text


def _places(value: float) -> int:
    """Decimal places of a bound as written (0.25: 2, 2.5: 1, 1: 0)."""
    exponent = Decimal(repr(value)).normalize().as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0


def _interval(low: float | Fraction, high: float | Fraction) -> str:
    """``(0.25, 0.5] s``; ``(2560, +Inf) s`` without an upper bound."""
    if high == math.inf:
        return f"({_figure(low)}, +Inf) s"
    return f"({_figure(low)}, {_figure(high)}] s"


def _le(bound: float) -> str:
    """A bucket bound as Prometheus' ``le`` label spells the unbounded one."""
    return "+Inf" if bound == math.inf else _figure(bound)


def _percent(share: Fraction | float) -> str:
    """A share as a percentage to three significant figures (the counts beside it are exact)."""
    return f"{float(share) * 100:.3g}%"


def _clock(epoch: float) -> str:
    """``12:00:30Z``: a window's end as the operator's line shows it (the document has full stamps)."""
    try:
        return time.strftime("%H:%M:%SZ", time.gmtime(epoch))
    except (ValueError, OverflowError, OSError):
        return utc_stamp(epoch)


def _short(err: Exception) -> str:
    text = one_line(err)
    return text if len(text) <= 120 else text[:117] + "..."


def _series_text(key: SeriesKey) -> str:
    name, labels = key
    return one_line(name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""))
