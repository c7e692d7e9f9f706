"""An engine's preStop hook: wait until no request is in flight, so stopping loses no work.

Kubernetes removes a terminating pod from its Service's endpoints and runs this hook before it
sends SIGTERM.  We give the router a moment to notice, then poll the engine's own Prometheus
metrics until queued, running and paused requests stay at zero, or the deadline passes.

Standard library only: the operator ships this file in the run's ConfigMap, so it runs inside any
engine image, the official SGLang image included (``python3 /etc/mixrl/drain.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request

# SGLang's gauges (the torch engine exports the same names); Prometheus clients without UTF-8 name
# support write the colon as an underscore.  A paused engine holds its requests under
# num_paused_reqs (the torch engine then reports none running), so without it a drain during a
# pause would call the engine idle with work held; an engine that lacks a gauge adds nothing.
IN_FLIGHT_GAUGES = ("num_running_reqs", "num_queue_reqs", "num_paused_reqs")


def parse_sample(line: str) -> tuple[str, float] | None:
    """``name{labels} value [timestamp]`` -> (name, value); None for comments and blank lines."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    if "{" in line:
        name, _, rest = line.partition("{")
        value_part = rest.rpartition("}")[2]
    else:
        name, _, value_part = line.partition(" ")
    fields = value_part.split()
    return (name.strip(), float(fields[0])) if fields else None


def in_flight(metrics_text: str) -> float:
    """Queued, running and paused requests in a Prometheus text exposition (summed over label
    sets; a gauge the exposition lacks counts 0)."""
    total = 0.0
    for line in metrics_text.splitlines():
        sample = parse_sample(line)
        if (
            sample is not None
            and sample[0].removeprefix("sglang:").removeprefix("sglang_") in IN_FLIGHT_GAUGES
        ):
            total += sample[1]
    return total


def fetch_metrics(port: int, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
            return response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return None


def drain(port: int, deadline_s: float, settle_s: float, poll_s: float, idle_polls: int = 2) -> str:
    """Wait for the engine to go idle; returns why we stopped waiting (for the log)."""
    time.sleep(settle_s)
    start = time.monotonic()
    idle = 0
    while time.monotonic() - start < deadline_s:
        text = fetch_metrics(port, timeout=min(5.0, poll_s * 2 + 1))
        if text is None:
            return "engine not answering; nothing left to drain"
        idle = idle + 1 if in_flight(text) == 0 else 0
        if idle >= idle_polls:
            return f"idle after {time.monotonic() - start:.0f}s"
        time.sleep(poll_s)
    return f"deadline of {deadline_s:.0f}s reached with requests in flight"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="drain", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="engine HTTP port (serves /metrics)")
    parser.add_argument("--timeout", type=float, default=300.0, help="longest wait, seconds")
    parser.add_argument(
        "--settle", type=float, default=5.0, help="wait first, for endpoint removal to spread"
    )
    parser.add_argument("--poll", type=float, default=2.0, help="seconds between polls")
    args = parser.parse_args(argv)
    print(f"drain: {drain(args.port, args.timeout, args.settle, args.poll)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
