"""vLLM 0.32.0's engine metrics that flatshare-ops reads, by vLLM's own names (standard library only).

The canary analysis (:mod:`flatshare_ops.control.analysis`) reads them from the engine's
``GET /metrics``; the stand-in engine and the alert rules can name the same series from here.
Every fact below is vLLM 0.32.0's ``vllm/v1/metrics/loggers.py`` and ``vllm/v1/metrics/buckets.py``
(docs/reference/vllm.md#metrics).
"""

import threading

#: Every series carries these labels: the served model name and the engine index (one per data-parallel engine).
LABELS = ("model_name", "engine")

#: Histogram of the time from a request's arrival to its first token, seconds.
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
#: Histogram of a request's end-to-end latency, seconds.
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
#: Counter of finished requests, by ``finished_reason`` (the sample name; the family is ``vllm:request_success``).
REQUEST_SUCCESS = "vllm:request_success_total"
#: Gauge of the requests waiting to be scheduled.
REQUESTS_WAITING = "vllm:num_requests_waiting"
#: Gauge of the requests in the engine's running batches (at most its ``--max-num-seqs``).
REQUESTS_RUNNING = "vllm:num_requests_running"
#: Gauge of the KV cache's use, a share from 0 to 1 (1 = every block in use).
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"

#: ``finished_reason`` values (vLLM's ``FinishReason``): stop (a stop string or token), length (max_tokens or
#: max_model_len), abort (the client went away), error (a request-level internal error, answered 500), repetition.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
#: The reasons the analysis counts as a request that did not end well.
ERROR_REASONS = ("abort", "error")

#: ``vllm:time_to_first_token_seconds``' bucket upper bounds (seconds; Prometheus adds ``+Inf``).
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
#: The request-latency histograms' bucket upper bounds (``vllm:e2e_request_latency_seconds`` and the queue,
#: prefill and decode time histograms; seconds; Prometheus adds ``+Inf``).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def read_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a ``GET /metrics`` text as ``(name, labels, value)``, in order, read by
    prometheus_client's own parser of the text format (imported here, not at import time: serving-check,
    which reads its few sums with its own small reader, check/facts.py ``parse_metrics``, never pays for it).

    The one reader of an engine's metrics text for the operator's canary analysis (control/analysis.py) and the
    node's admission load (node/probe.py ``engine_load``).

    Raises:
        ValueError: the text is not Prometheus' text format (the parser's own words; the parser raises
            IndexError for some malformed label sets, e.g. ``a{b="c", ="x"} 2``, and that says it too).
    """
    try:
        return [(s.name, dict(s.labels), float(s.value)) for family in _parser()(text) for s in family.samples]
    except LookupError as err:
        raise ValueError(f"not Prometheus' text format ({type(err).__name__}: {err})") from None


_PARSER: list = []  # the parser function, once imported
_IMPORTING = threading.Lock()
#: The name prometheus_client's parser modules are imported under when the client itself is not imported.
_PRIVATE = "flatshare_ops._prometheus_client"


def _parser():
    """prometheus_client's ``parser.text_string_to_metric_families``, imported without running the package's
    ``__init__``.

    That ``__init__`` imports the whole client (its registry, metric classes and every exposition: HTTP server,
    WSGI, ASGI, push gateway): about 70 ms of CPU, where the parser and what it imports (metrics_core, samples,
    validation, all by relative imports) take 20. The node's probe and every switch's admission read one metrics
    page in a process of their own, so that is most of what reading it costs them. The client's directory is
    imported as a package of another name (:data:`_PRIVATE`), made from its spec but not run, and the parser as
    its submodule: ``prometheus_client`` in ``sys.modules`` is never touched, so another thread's or a later
    ``import prometheus_client`` gets the whole client. A process that has imported the client uses its parser.
    """
    if not _PARSER:
        with _IMPORTING:  # the rollout reads its nodes' pages from several threads
            if not _PARSER:
                _PARSER.append(_import_parser())
    return _PARSER[0]


def _import_parser():
    import importlib
    import importlib.util
    import sys

    spec = importlib.util.find_spec("prometheus_client")  # finds the package; runs nothing of it
    if "prometheus_client" in sys.modules or spec is None or spec.origin is None:
        from prometheus_client.parser import text_string_to_metric_families  # (no spec: ModuleNotFoundError)

        return text_string_to_metric_families
    private = importlib.util.spec_from_file_location(_PRIVATE, spec.origin,
                                                     submodule_search_locations=spec.submodule_search_locations)
    assert private is not None  # a file location and its search locations always give a spec
    sys.modules[_PRIVATE] = importlib.util.module_from_spec(private)
    return importlib.import_module(f"{_PRIVATE}.parser").text_string_to_metric_families
