"""The launch table reproduces the command lines the operator's builders wrote before it existed.

``command_lines.json`` holds, for every example run and a few variants (CPU, a
one-node multi-GPU trainer), the manifest and the command of every container the builders made
before :func:`mixrl.api.launch.component_command` became their only source; both the table and the
builders built on it must still produce exactly those.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mixrl.api.launch import COMPONENTS, Component, component_command
from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.operator.builders.objects import BuildOptions, Owner
from mixrl.operator.builders.podspec import pod_where
from mixrl.operator.builders.pools import pool_children
from mixrl.operator.builders.resources import run_objects, seed_replicas

GOLDEN: dict[str, Any] = json.loads((Path(__file__).parent / "command_lines.json").read_text())


def resolved_of(key: str) -> ResolvedRun:
    run = parse_document(GOLDEN[key]["manifest"])
    assert isinstance(run, RLRun)
    return resolve(run)


def table_command(resolved: ResolvedRun, workload: str, container: str) -> list[str]:
    assert container in COMPONENTS, container
    component: Component = container  # type: ignore[assignment]  # checked just above
    pool = next((p for p in resolved.pools if p.object_name == workload), None)
    return component_command(resolved, component, pod_where(resolved), pool)


def built_commands(resolved: ResolvedRun) -> dict[str, list[str]]:
    options = BuildOptions()
    objects = run_objects(resolved, Owner("mixrl.dev/v1alpha1", "RLRun", resolved.name, "u"), options)
    for pool in resolved.pools:
        owner = Owner("mixrl.dev/v1alpha1", "SamplerPool", pool.object_name, "p")
        objects += pool_children(resolved, pool, seed_replicas(pool), owner, options)
    commands = {}
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            spec = obj["spec"]["template"]["spec"]
            name = f"{obj['kind']}/{obj['metadata']['name']}"
            for container in [*spec.get("initContainers", []), *spec["containers"]]:
                commands[f"{name}/{container['name']}"] = container["command"]
    return commands


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_the_launch_table_gives_every_container_its_previous_command_line(key: str) -> None:
    resolved = resolved_of(key)
    for where, command in GOLDEN[key]["commands"].items():
        _, workload, container = where.split("/")
        assert table_command(resolved, workload, container) == command, where


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_the_builders_write_the_same_command_lines(key: str) -> None:
    assert built_commands(resolved_of(key)) == GOLDEN[key]["commands"]
