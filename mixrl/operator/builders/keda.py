"""KEDA mode (``autoscaling.engine: keda``): one ScaledObject per SamplerPool, built purely.

KEDA then drives the SamplerPool's scale subresource through an HPA it owns, with the same
Prometheus query and thresholds as the built-in loop.  KEDA's Prometheus trigger uses
``metricType: AverageValue``: HPA divides the query's total by the threshold, so
``desired = ceil(load / (targetPerReplica · capacity))`` whatever the pods' readiness — starting
replicas count as capacity there too.  What KEDA cannot express of mixrl's policy: the spike
confirmation, the burst allowance, scale-down headroom, the weight-update hold, the release of
replicas the cluster reports stuck and the shared budget (docs/autoscaling.md compares the two).
"""

from __future__ import annotations

import math

from mixrl.api.kube_types import Obj
from mixrl.api.models import API_VERSION
from mixrl.api.resolve import ResolvedPool, ResolvedRun
from mixrl.operator.autoscaling.policy import HPA_SCALE_UP_PERCENT
from mixrl.operator.autoscaling.promql import load_query
from mixrl.operator.builders import labels as L
from mixrl.operator.builders.objects import Owner, with_hash

KEDA_API_VERSION = "keda.sh/v1alpha1"
FALLBACK_FAILURE_THRESHOLD = 3
"""Failed metric reads in a row before KEDA applies ``fallback.replicas``."""


def _quantity(value: float) -> str:
    """KEDA reads trigger metadata as strings; keep integers integral ("16", not "16.0")."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def keda_scaled_object(
    run: ResolvedRun, pool: ResolvedPool, owner: Obj, labels: dict[str, str] | None = None
) -> Obj:
    """The ScaledObject of one pool; ``owner`` is an ownerReference (normally the SamplerPool's)."""
    for key in ("apiVersion", "kind", "name", "uid"):
        if not owner.get(key):
            raise ValueError(f"owner.{key}: an ownerReference needs it")
    autoscaling = run.autoscaling
    capacity = pool.capacity if pool.capacity is not None else 1.0
    poll = max(1, math.ceil(autoscaling.poll_interval_seconds))
    window = math.ceil(autoscaling.scale_down_window_seconds)
    spec: Obj = {
        "scaleTargetRef": {"apiVersion": API_VERSION, "kind": "SamplerPool", "name": pool.object_name},
        "pollingInterval": poll,
        "cooldownPeriod": window,
        "minReplicaCount": pool.min_replicas,
        "maxReplicaCount": pool.max_replicas,
        "advanced": {
            "horizontalPodAutoscalerConfig": {
                "behavior": {
                    "scaleDown": {
                        "stabilizationWindowSeconds": window,
                        "policies": [{"type": "Percent", "value": 100, "periodSeconds": poll}],
                    },
                    "scaleUp": {
                        "stabilizationWindowSeconds": 0,
                        "selectPolicy": "Max",
                        "policies": [
                            {"type": "Pods", "value": autoscaling.scale_up_limit, "periodSeconds": poll},
                            {"type": "Percent", "value": int(HPA_SCALE_UP_PERCENT), "periodSeconds": poll},
                        ],
                    },
                }
            }
        },
        "triggers": [
            {
                "type": "prometheus",
                "name": "load",
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": autoscaling.prometheus_url,
                    "query": load_query(autoscaling, run, pool),
                    "threshold": _quantity(autoscaling.target_per_replica * capacity),
                    "activationThreshold": _quantity(autoscaling.activation_threshold),
                    # No series is an error (-> fallback) unless the pool may be at zero: with no
                    # engine pods the engine query has nothing to return, and that means load 0.
                    "ignoreNullValues": "true" if pool.min_replicas == 0 else "false",
                },
            }
        ],
    }
    if autoscaling.fallback_replicas is not None:
        spec["fallback"] = {
            "failureThreshold": FALLBACK_FAILURE_THRESHOLD,
            "replicas": autoscaling.fallback_replicas,
        }
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": {
            "name": pool.object_name,
            "namespace": run.namespace,
            "labels": dict(labels or {}),
            "ownerReferences": [owner],
        },
        "spec": spec,
    }


def pool_scaled_object(run: ResolvedRun, pool: ResolvedPool, owner: Owner) -> Obj:
    """The ScaledObject the pool's controller applies in KEDA mode: owned by the SamplerPool (so it
    goes with the pool), labelled like the pool's other children, with its desired-hash."""
    return with_hash(keda_scaled_object(run, pool, owner.reference(), L.pool_labels(run, pool)))
