"""What reading one engine metrics page costs a process of its own: prometheus_client's parser imported alone
(common/vllm_metrics.py ``read_samples``) against the package imported whole.

The node's probe and every switch's admission read their engine's ``GET /metrics`` once, each in a process of its
own; importing ``prometheus_client.parser`` the usual way runs the package's ``__init__``, which imports the whole
client. The baseline, in the same run: a process that does that and parses the same page; the figure: a process
that parses it with ``read_samples``. A third line, for scale: a process that imports nothing. Each runs N times,
alternating; the CPU time (user + system) is read from ``getrusage(RUSAGE_CHILDREN)``, so the machine's load
changes the wall time, not the figures.

Run: .venv/bin/python bench/metrics_reader_cost.py [N]   (N = 20 by default; a few seconds)
"""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from cpu_log import run_cpu_s  # noqa: E402  (getrusage of the children around one run)

#: One page, given on stdin: a gauge as vLLM writes it.
PAGE = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
PROGRAMS = {
    "nothing imported": "import sys; sys.stdin.read()",
    "the package whole (baseline)": "import sys; from prometheus_client.parser import text_string_to_metric_families "
                                    "as parse; assert list(parse(sys.stdin.read()))",
    "read_samples": "import sys; from flatshare_ops.common.vllm_metrics import read_samples; "
                    "assert read_samples(sys.stdin.read())",
}


def _cpu_s(code: str) -> float:
    return run_cpu_s([sys.executable, "-c", code], cwd=REPO, input=PAGE, text=True, check=True)[1]


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    costs: dict[str, list[float]] = {name: [] for name in PROGRAMS}
    for _ in range(runs):
        for name, code in PROGRAMS.items():
            costs[name].append(_cpu_s(code))
    baseline = median(costs["the package whole (baseline)"])
    print(f"a process that reads one metrics page, CPU (median of {runs}):")
    for name in PROGRAMS:
        print(f"  {name:30} {median(costs[name]) * 1000:6.1f} ms  ({median(costs[name]) / baseline:.2f}x)")


if __name__ == "__main__":
    main()
