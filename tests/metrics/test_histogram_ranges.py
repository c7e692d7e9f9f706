"""Each histogram's buckets resolve the range it measures: the values its help promises to count
land in a finite bucket, not all in +Inf (where histogram_quantile can only answer the top bound)."""

from __future__ import annotations

import inspect

from mixrl.rl import metrics as m
from mixrl.rl.rollout.router_client import RouterClient
from mixrl.rl.router.cli import build_parser
from mixrl.rl.router.server import RouterSettings


def test_router_latency_reaches_past_the_request_timeout() -> None:
    """The latency histogram observes 504s (the router's --request-timeout, 900 s by default) and
    499s (the rollout's client gives up at 600 s): a top bucket of 300 s lost both in +Inf."""
    buckets = m.MIXRL_ROUTER_REQUEST_LATENCY.buckets
    assert buckets is not None and list(buckets) == sorted(buckets)
    top = max(buckets)
    assert top > RouterSettings().request_timeout
    assert top > build_parser().get_default("request_timeout")
    client = inspect.signature(RouterClient.__init__).parameters["request_timeout_s"].default
    assert top > client
