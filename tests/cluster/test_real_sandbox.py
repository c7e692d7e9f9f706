"""The coding environment with ``spec.rollout.sandbox`` on the real node: every sandboxed command
of an episode (the model's ``run``, the hidden tests) runs in a sandbox pod of its own, which the
rollout worker creates through the API server under its run's ServiceAccount, leases once, and
deletes (docs/sandbox.md#sandbox-pods-in-a-cluster). The trainer steps on the rewards those pods'
test runs gave."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import yaml

from tests.cluster.conftest import Bed, wait_for
from tests.cluster.real_run import ROOT, buffer_stats, describe

NAMESPACE = "rl-coding"
EXAMPLE = ROOT / "examples" / "rlrun-coding.yaml"


def sandbox_pods(bed: Bed) -> list[dict]:
    return [p for p in bed.get("pods", "-n", NAMESPACE)["items"] if "-sb-" in p["metadata"]["name"]]


@pytest.fixture(scope="module")
def coding(real_chart: Bed) -> Iterator[tuple[Bed, dict[str, str]]]:
    """The run at step 2, and every sandbox pod seen on the way (name -> uid)."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    run = manifest["metadata"]["name"]
    manifest["spec"]["rollout"]["sandbox"] = {"poolSize": 2, "resources": {"cpu": "250m", "memory": "256Mi"}}
    manifest["spec"]["evaluation"] = {"everySteps": 4, "passK": [1], "samplesPerTask": 1}
    real_chart.kubectl("create", "namespace", NAMESPACE)
    real_chart.apply(manifest, namespace=NAMESPACE)
    seen: dict[str, str] = {}

    def two_steps() -> bool:
        for pod in sandbox_pods(real_chart):
            seen[pod["metadata"]["name"]] = pod["metadata"]["uid"]
        return (buffer_stats(real_chart, NAMESPACE).get("committed_step") or -1) >= 2

    started = time.monotonic()
    try:
        wait_for(two_steps, timeout=480, interval=1, what="two trainer steps of the coding run")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe(real_chart, NAMESPACE)}") from None
    print(
        f"coding run with sandbox pods: step 2 in {time.monotonic() - started:.0f} s, {len(seen)} sandbox pods seen"
    )
    yield real_chart, seen
    real_chart.kubectl("delete", "rlr", run, "-n", NAMESPACE, "--wait=false")


def test_sandboxed_commands_run_in_pods_of_their_own(coding: tuple[Bed, dict[str, str]]) -> None:
    bed, seen = coding
    # A warm pool of two, and every lease replaced by a fresh pod: many more than two over two steps.
    assert len(seen) > 2, seen
    now = {p["metadata"]["name"] for p in sandbox_pods(bed)}
    assert len(seen.keys() - now) >= 1, "no sandbox pod was deleted after its command"


def test_the_sandbox_pods_are_locked_down(coding: tuple[Bed, dict[str, str]]) -> None:
    bed, _ = coding
    pod = wait_for(lambda: next(iter(sandbox_pods(bed)), None), what="a sandbox pod")
    spec = pod["spec"]
    assert spec.get("automountServiceAccountToken") is False
    (container,) = spec["containers"]
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["capabilities"]["drop"] == ["ALL"]
    assert spec["securityContext"]["runAsNonRoot"] is True
