"""KWOK stages of the test bed: how a simulated node becomes Ready and a pod Running.

KWOK has no built-in lifecycle: its controller plays the Stage objects it is given. These are the
smallest honest set for mixrl's tests: a node reports Ready with its address; a scheduled pod
reports every container running and ready, with a pod IP (so Services get endpoints); a pod being
deleted goes away (no kubelet to run its shutdown). Nodes get no heartbeats: the test bed gives the
controller-manager's node-lifecycle controller a year's grace instead (see :mod:`.cluster`), which
saves thousands of lease writes per minute on a 1,000-node fleet.

A **cold start** can be played: a pod whose ``nodeSelector`` asks for the label
:data:`START_DELAY_LABEL` (a duration, e.g. ``"40s"``; the test labels the nodes it puts it on)
is scheduled at once and becomes Running that long after, as a real node pulling an engine image
and loading a model would (the autoscaler must not take such a pod for a stuck one).
"""

from __future__ import annotations

import yaml

NODE_READY = """\
{{ $now := Now }}
conditions:
- type: Ready
  status: "True"
  reason: KubeletReady
  message: simulated by KWOK
  lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $now | Quote }}
{{ range list "MemoryPressure" "DiskPressure" "PIDPressure" "NetworkUnavailable" }}
- type: {{ . }}
  status: "False"
  reason: Simulated
  lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $now | Quote }}
{{ end }}
addresses:
- type: InternalIP
  address: {{ NodeIP | Quote }}
- type: Hostname
  address: {{ NodeName | Quote }}
nodeInfo:
  architecture: amd64
  operatingSystem: linux
  kubeletVersion: kwok
  containerRuntimeVersion: kwok
phase: Running
"""

POD_RUNNING = """\
{{ $now := Now }}
conditions:
{{ range list "PodScheduled" "Initialized" "ContainersReady" "Ready" }}
- type: {{ . }}
  status: "True"
  lastTransitionTime: {{ $now | Quote }}
{{ end }}
initContainerStatuses:
{{ range .spec.initContainers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: true
  restartCount: 0
  state: {terminated: {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }}, finishedAt: {{ $now | Quote }}}}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: true
  started: true
  restartCount: 0
  state: {running: {startedAt: {{ $now | Quote }}}}
{{ end }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
phase: Running
startTime: {{ $now | Quote }}
"""


START_DELAY_LABEL = "kwok.mixrl.dev/pod-start-delay"
"""A node label (and pod nodeSelector) whose value delays the pod's start: a Go duration."""


def _stage(name: str, kind: str, selector: list[dict], next_: dict, delay: dict | None = None) -> dict:
    spec: dict = {
        "resourceRef": {"apiGroup": "v1", "kind": kind},
        "selector": {"matchExpressions": selector},
        "next": next_,
    }
    if delay is not None:
        spec["delay"] = delay
    return {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": name}, "spec": spec}


def stages() -> list[dict]:
    not_ready = {
        "key": '.status.conditions.[] | select( .type == "Ready" ) | .status',
        "operator": "NotIn",
        "values": ["True"],
    }
    return [
        _stage("node-ready", "Node", [not_ready], {"statusTemplate": NODE_READY}),
        _stage(
            "pod-running",
            "Pod",
            [
                {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                {"key": ".status.phase", "operator": "In", "values": ["Pending"]},
                not_ready,
            ],
            {"statusTemplate": POD_RUNNING},
            # No label asked for: no delay (a missing value falls back to 0 ms).
            delay={
                "durationMilliseconds": 0,
                "durationFrom": {"expressionFrom": f'.spec.nodeSelector["{START_DELAY_LABEL}"]'},
            },
        ),
        _stage(
            "pod-delete",
            "Pod",
            [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}],
            {"delete": True},
        ),
    ]


def stages_yaml() -> str:
    return yaml.safe_dump_all(stages(), sort_keys=False)
