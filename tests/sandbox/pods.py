"""Stand-ins for the pod API of a sandbox pool's tests (mixrl.rl.sandbox.kubernetes.PodClient)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def executor_template(port: int = 8790) -> dict[str, Any]:
    """The least of a sandbox pod template: the executor's named port."""
    return {
        "kind": "Pod",
        "metadata": {},
        "spec": {"containers": [{"ports": [{"name": "executor", "containerPort": port}]}]},
    }


class InstantPods:
    """A PodClient whose pods are ready, at ``ip``, as soon as they are created."""

    def __init__(self, ip: str = "10.0.0.1") -> None:
        self.ip = ip
        self.pods: dict[str, dict[str, Any]] = {}
        self.deleted: list[str] = []

    async def create(self, pod: dict[str, Any]) -> None:
        self.pods[pod["metadata"]["name"]] = pod

    async def get(self, name: str) -> dict[str, Any] | None:
        if name not in self.pods:
            return None
        ready = {"phase": "Running", "podIP": self.ip, "conditions": [{"type": "Ready", "status": "True"}]}
        return {**self.pods[name], "status": ready}

    async def list(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return list(self.pods.values())

    async def delete(self, name: str) -> None:
        self.deleted.append(name)
        self.pods.pop(name, None)
