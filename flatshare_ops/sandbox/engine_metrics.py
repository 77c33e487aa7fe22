"""The stand-in engine's ``/metrics``: vLLM 0.32.0's own series, names, labels and buckets (standard library only).

What vLLM's ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``, buckets from
``vllm/v1/metrics/buckets.py``) serves for one engine, for the series flatshare-ops reads
(docs/reference/vllm.md#metrics):

- ``vllm:time_to_first_token_seconds`` and ``vllm:e2e_request_latency_seconds``, histograms
  (``_bucket{le=...}``, ``_count``, ``_sum``), and ``vllm:request_success_total`` by
  ``finished_reason`` (stop, length, abort, error, repetition, each present from the start);
- the gauges ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``; the counters
  ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``;
- every one with the labels ``engine="0"`` and ``model_name`` (the served model name);
  ``vllm:cache_config_info`` (a gauge at 1 whose labels are cache settings);
- the ``_created`` gauge prometheus_client adds beside each counter and histogram (the time the
  series began: the engine's start, or the last :meth:`EngineMetrics.reset`);

and make-room's ``flatshare:make_room_turns_announced_total``, which serving-check reads.
The text is written as prometheus_client 0.26 writes it (labels sorted by name, values as Go
formats floats), so a Prometheus text parser reads it as it reads vLLM's.
"""

from __future__ import annotations

import math
import threading
import time

from .completions import FINISH_REASONS

#: vLLM 0.32.0's ``TIME_TO_FIRST_TOKEN_BUCKETS`` (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
#: vLLM 0.32.0's ``REQUEST_LATENCY_BUCKETS`` (seconds), which ``vllm:e2e_request_latency_seconds`` uses.
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

TTFT = "vllm:time_to_first_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
SUCCESS = "vllm:request_success"
TURNS = "flatshare:make_room_turns_announced_total"

#: A body that Prometheus' text parsers refuse (an unclosed label set, a value that is no number):
#: what the engine serves when its behaviour says ``metrics = "malformed"``.
MALFORMED = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="flatshare-chat" 1.0\n'
    "vllm:request_success_total{engine=0} lots\n"
)


def go_float(value: float) -> str:
    """A float as prometheus_client writes it (Go's formatting: ``1.0``, ``+Inf``, ``1.7e+09``)."""
    value = float(value)
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:  # Go switches to an exponent sooner than Python
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


def _labels(labels: dict[str, str]) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in sorted(labels.items())) + "}" if labels else ""


def _family(name: str, kind: str, documentation: str, samples: list[tuple[str, dict[str, str], float]]) -> str:
    lines = [f"# HELP {name} {documentation}", f"# TYPE {name} {kind}"]
    lines += [f"{sample}{_labels(labels)} {go_float(value)}" for sample, labels, value in samples]
    return "\n".join(lines) + "\n"


class Histogram:
    """A Prometheus histogram's state: a count per bucket (not cumulative), the count and the sum."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Add ``times`` observations of ``value`` (a value on a bound falls in that bound's bucket: ``le``)."""
        index = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        self.counts[index] += times
        self.count += times
        self.sum += value * times

    def samples(self, name: str, labels: dict[str, str]) -> list[tuple[str, dict[str, str], float]]:
        """``NAME_bucket`` (cumulative, ``le`` as Go writes it), ``NAME_count``, ``NAME_sum``."""
        result, cumulative = [], 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            cumulative += count
            result.append((f"{name}_bucket", {**labels, "le": go_float(bound)}, float(cumulative)))
        return result + [(f"{name}_count", labels, float(self.count)), (f"{name}_sum", labels, self.sum)]


class EngineMetrics:
    """What the stand-in engine counts, and its ``/metrics`` text.

    Every change goes through a method (each holds the lock), so a scrape never sees half an update.
    """

    def __init__(self, model_name: str, cache_labels: dict[str, str]) -> None:
        self.model_name = model_name
        self.cache_labels = cache_labels
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self._zero()

    def _zero(self) -> None:
        self.created = time.time()
        self.turns = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def reset(self) -> None:
        """Every counter and histogram back to zero, as after an engine restart (the gauges stay what they are)."""
        with self.lock:
            self._zero()

    def turn_announced(self) -> None:
        """One voice turn hint arrived."""
        with self.lock:
            self.turns += 1

    def move(self, waiting: int = 0, running: int = 0) -> None:
        """Change the waiting and running gauges by these amounts."""
        with self.lock:
            self.waiting += waiting
            self.running += running

    def finished(self, reason: str, ttft_s: float | None, e2e_s: float, prompt_tokens: int, generation_tokens: int,
                 times: int = 1) -> None:
        """Record ``times`` finished requests alike.

        Args:
            reason: one of :data:`~.completions.FINISH_REASONS`.
            ttft_s: seconds from arrival to the first token; None when no token was produced (not observed).
            e2e_s: seconds from arrival to the end.
            prompt_tokens, generation_tokens: each request's tokens.

        Raises:
            ValueError: an unknown finish reason.
        """
        if reason not in self.success:
            raise ValueError(f"finished_reason must be one of {', '.join(FINISH_REASONS)}, got {reason!r}")
        with self.lock:
            self.success[reason] += times
            if ttft_s is not None:
                self.ttft.observe(ttft_s, times)
            self.e2e.observe(e2e_s, times)
            self.prompt_tokens += prompt_tokens * times
            self.generation_tokens += generation_tokens * times

    def exposition(self) -> str:
        """The Prometheus text (format 0.0.4), as vLLM 0.32.0 with one engine writes these series."""
        base = {"engine": "0", "model_name": self.model_name}
        with self.lock:
            parts = [
                _family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                        [("vllm:num_requests_running", base, self.running)]),
                _family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                        [("vllm:num_requests_waiting", base, self.waiting)]),
                _family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                        [("vllm:prompt_tokens_total", base, self.prompt_tokens)]),
                _family("vllm:prompt_tokens_created", "gauge", "Number of prefill tokens processed.",
                        [("vllm:prompt_tokens_created", base, self.created)]),
                _family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
                        [("vllm:generation_tokens_total", base, self.generation_tokens)]),
                _family("vllm:generation_tokens_created", "gauge", "Number of generation tokens processed.",
                        [("vllm:generation_tokens_created", base, self.created)]),
                _family(f"{SUCCESS}_total", "counter", "Count of successfully processed requests.",
                        [(f"{SUCCESS}_total", {**base, "finished_reason": r}, n) for r, n in self.success.items()]),
                _family(f"{SUCCESS}_created", "gauge", "Count of successfully processed requests.",
                        [(f"{SUCCESS}_created", {**base, "finished_reason": r}, self.created) for r in FINISH_REASONS]),
                _family(TTFT, "histogram", "Histogram of time to first token in seconds.", self.ttft.samples(TTFT, base)),
                _family(f"{TTFT}_created", "gauge", "Histogram of time to first token in seconds.",
                        [(f"{TTFT}_created", base, self.created)]),
                _family(E2E, "histogram", "Histogram of e2e request latency in seconds.", self.e2e.samples(E2E, base)),
                _family(f"{E2E}_created", "gauge", "Histogram of e2e request latency in seconds.",
                        [(f"{E2E}_created", base, self.created)]),
                _family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
                        [("vllm:cache_config_info", {**self.cache_labels, "engine": "0"}, 1.0)]),
                _family(TURNS, "counter", "Voice turns announced to make-room.", [(TURNS, {}, self.turns)]),
            ]
        return "".join(parts)
