"""A spec edit mid-run restarts every component that reads what changed: each component's pod
template carries the hash of the resolved run's sections it reads (``CONFIG_SECTIONS``), and the
run's ConfigMap alone would change nothing in a running process (each reads ``run.json`` once, at
start)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import resolve
from mixrl.operator.builders.objects import CONFIG_HASH_ANNOTATION, BuildOptions, Owner
from mixrl.operator.builders.resources import run_objects

from .support import small_run

Obj = dict[str, Any]


def pod_hashes(manifest: Obj) -> dict[str, str]:
    """Workload name suffix -> its pods' config hash."""
    run = parse_document(manifest)
    assert isinstance(run, RLRun)
    resolved = resolve(run)
    owner = Owner("mixrl.dev/v1alpha1", "RLRun", resolved.name, "uid-demo")
    return {
        obj["metadata"]["name"].removeprefix("demo-"): obj["spec"]["template"]["metadata"]["annotations"][
            CONFIG_HASH_ANNOTATION
        ]
        for obj in run_objects(resolved, owner, BuildOptions())
        if obj["kind"] in ("Deployment", "StatefulSet")
    }


def routing(spec: Obj, floor: float) -> None:
    spec["health"] = {"routing": {"klThreshold": 0.05, "extremeShareThreshold": 0.1, "floor": floor}}


def context(spec: Obj, tokens: int) -> None:
    spec["model"]["maxContextTokens"] = tokens


def samples(spec: Obj, n: int) -> None:
    spec["algorithm"] = {"samplesPerPrompt": n}


def prompts(spec: Obj, n: int) -> None:
    spec["algorithm"] = {"promptsPerUpdate": n}


def steps(spec: Obj, n: int) -> None:
    spec["trainer"]["totalSteps"] = n


@pytest.mark.parametrize(
    ("edit", "before", "after", "component", "what"),
    [
        # the router's traffic shares: health = policy_of(run.health.routing)
        (routing, 0.1, 0.3, "router", "health.routing"),
        # the router's request body limit and the buffer's largest trajectory
        (context, 32768, 8192, "router", "model.maxContextTokens"),
        (context, 32768, 8192, "buffer", "model.maxContextTokens"),
        # the rollout workers' group size, batch, staleness bound and end (mixrl.rl.rollout.worker)
        (samples, 8, 4, "rollout", "algorithm.samplesPerPrompt"),
        (prompts, 128, 64, "rollout", "algorithm.promptsPerUpdate"),
        (steps, 100, 200, "rollout", "trainer.totalSteps"),
    ],
)
def test_an_edit_restarts_each_component_that_reads_it(
    edit: Callable[[Obj, Any], None], before: Any, after: Any, component: str, what: str
) -> None:
    old, new = small_run(), small_run()
    edit(old["spec"], before)
    edit(new["spec"], after)
    assert pod_hashes(old)[component] != pod_hashes(new)[component], (
        f"{component} reads {what}: a change must roll its pods"
    )


def test_a_change_a_component_does_not_read_leaves_it_running() -> None:
    base = small_run()
    trainer = copy.deepcopy(base)
    trainer["spec"]["trainer"]["gpuType"] = "B200"
    assert pod_hashes(base)["router"] == pod_hashes(trainer)["router"], "the router reads no trainer field"


def test_a_trainer_only_edit_leaves_the_rollout_workers_running() -> None:
    # The workers read four of the trainer's fields; a learning rate changed mid-run must not cut
    # their episodes short.
    base = small_run()
    tuned = copy.deepcopy(base)
    tuned["spec"]["trainer"].setdefault("optimizer", {})["lr"] = 3e-6
    before, after = pod_hashes(base), pod_hashes(tuned)
    assert before["trainer"] != after["trainer"], "the trainer reads its learning rate"
    assert before["rollout"] == after["rollout"]
