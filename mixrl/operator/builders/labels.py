"""Labels and names of every object the operator creates (docs/architecture.md#objects-and-labels).

Selector labels are a stable subset: a Deployment's or StatefulSet's selector is immutable, so it
holds only what can never change for that workload (run, component, pool).  Descriptive labels
(GPU type, precision) may change with the spec and live on the objects and pod templates only.
"""

from __future__ import annotations

from typing import Literal

from mixrl.api.resolve import ResolvedPool, ResolvedRun

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = "app.kubernetes.io/managed-by"
POOL = "mixrl.dev/pool"
GPU_TYPE = "mixrl.dev/gpu-type"
PRECISION = "mixrl.dev/precision"

APP = "mixrl"
MANAGER = "mixrl-operator"

Component = Literal["trainer", "sampler", "router", "rollout", "buffer", "run", "sandbox"]
"""``run`` marks the objects shared by the whole run (ConfigMap, token Secret, weights volume, PodMonitor)."""

# Children are named <run>-<suffix> for components and <run>-<pool> for pools, so a pool may not be
# named like a component suffix (it would collide with the component's objects): the API rejects
# those names (mixrl.api.models.RESERVED_POOL_NAMES, which a test keeps equal to these).  ``evaluator``
# is the BF16 evaluator's pool and process name (mixrl.api.resolve.EVALUATOR_POOL; mixrl run only).
COMPONENT_SUFFIXES = ("config", "trainer", "router", "rollout", "buffer", "weights", "evaluator")


def selector_labels(run: str, component: Component, pool: str | None = None) -> dict[str, str]:
    labels = {NAME: APP, INSTANCE: run, COMPONENT: component}
    if pool is not None:
        labels[POOL] = pool
    return labels


def component_labels(resolved: ResolvedRun, component: Component) -> dict[str, str]:
    labels = {**selector_labels(resolved.name, component), MANAGED_BY: MANAGER}
    if component == "trainer":
        labels[GPU_TYPE] = resolved.trainer.spec.gpu_type
        labels[PRECISION] = resolved.trainer.spec.precision
    return labels


def pool_labels(resolved: ResolvedRun, pool: ResolvedPool) -> dict[str, str]:
    return {
        **selector_labels(resolved.name, "sampler", pool.name),
        MANAGED_BY: MANAGER,
        GPU_TYPE: pool.gpu_type,
        PRECISION: pool.weight_precision,
    }


def selector_string(labels: dict[str, str]) -> str:
    """``k=v,k=v``: the form of ``status.selector`` that HPA and KEDA read from the scale subresource."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def child_name(run: str, suffix: str) -> str:
    return f"{run}-{suffix}"
