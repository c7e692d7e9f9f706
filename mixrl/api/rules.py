"""The cross-field rules of the RLRun API, each defined once for the two places that enforce it.

``mixrl validate`` and the operator enforce them through one pydantic validator (:func:`enforce`,
run by :class:`mixrl.api.models.Model` for every model a rule names); a Kubernetes API server
enforces them at admission through the CEL ``x-kubernetes-validations`` that :mod:`mixrl.api.crd`
writes into the CRDs.  Both take the condition, the field, the message and the GPU facts from the
same :class:`Rule`, so ``kubectl apply`` refuses an invalid RLRun with the same one-line reason that
``mixrl validate`` prints (tests/api/test_cel_rules.py runs every rule's cases through both, and
tests/cluster/test_admission.py through a real API server).

A :class:`Rule` names the models (schema nodes) it applies to, the field it is reported on, its
message template (Python formats it for pydantic; for CEL the same text becomes a
``messageExpression`` whose ``{placeholders}`` are CEL expressions) and its condition twice, side by
side: ``holds`` in Python on the model instance, and ``condition`` in CEL, built per model so that an
absent field reads as that model's default, and from the GPU table passed in (the real one unless a
test passes another).

How the API server's CEL sees a document, and what follows from it:

- a null field is not ``has()``, exactly like an absent one; where the two differ
  (``corrections.mis``: absent means the paper's range, null means off) the CRD carries the default,
  so the API server fills it in before the rules run (:attr:`Rule.server_defaults`);
- no message holds a float: CEL's ``string(double)`` formats like Go (``5``), Python like ``5.0``;
- rules over the pool list are quadratic, and the API server refuses a CRD whose estimated rule
  cost is too high, so that list has a ``maxItems`` (:data:`MAX_SAMPLER_POOLS`), as has ``passK``;
- CEL integers are int64 and an overflow fails the request with an evaluation error, so no rule
  multiplies int32 fields freely: the parallelism rules divide one size at a time, and the GPU-budget
  sum multiplies by ``gpusPerReplica``, which the schema bounds at 64;
- the API server does not default nested objects, so a field of one (``parallelism.tp``) reads as its
  default when either level is absent (:meth:`Node.nested_value`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import string
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError, PydanticUndefined

from mixrl.api.gpus import (
    FP8_KV_CACHE_NEEDS_CORES,
    GPU_TABLE,
    PRECISION_CORES,
    WEIGHTS_NEED_CORES,
    GpuCapability,
)
from mixrl.api.pod_dirs import POD_DIRS, colliding_dir
from mixrl.api.tiny import TINY_KINDS, tiny_kind

GpuTable = Mapping[str, GpuCapability]
Reason = Literal["FieldValueInvalid", "FieldValueForbidden"]
"""The API server's error kinds for a failed rule.  Not FieldValueDuplicate: with it the API server
prints the value instead of the message."""

LOW_PRECISIONS: frozenset[str] = frozenset({"fp8", "mxfp4", "nvfp4"})
URL_SCHEME = "^[A-Za-z][A-Za-z0-9+.-]*://"
"""A location that starts like a URL (``s3://``, ``https://``…), as opposed to a path."""
"""Weight precisions whose KV cache defaults to fp8."""
RESERVED_POOL_NAMES: frozenset[str] = frozenset(
    {"config", "trainer", "router", "rollout", "buffer", "weights", "evaluator"}
)
"""Suffixes of the run's own children (``<run>-trainer``…): a pool with one of these names would collide."""
RESERVED_SERIES_POOL_NAMES: frozenset[str] = frozenset({"run", "all"})
"""Names of the run-wide figures: the collapse signs' run scope (mixrl.rl.health.collapse.RUN) and the
``pool`` label of the trainer's whole-batch series (mixrl.rl.trainer.telemetry.ALL_POOLS).  A pool
so named would take the run's place in both."""
SERIES_NAME_REASON = "the whole run's figures (metrics label pool 'all', collapse signs scope 'run')"
MAX_RUN_NAME = 30
"""Children are named ``<run>-<pool>-<suffix>`` and must stay DNS labels (63 characters)."""
MAX_SAMPLER_POOLS = 32
"""Pools per run: far more than GPU types times precisions, few enough for the API server's CEL cost
budget (the pool-name uniqueness rule is quadratic in the list's maxItems)."""
MAX_PASS_K = 16
"""Entries of ``evaluation.passK`` (the rule finding the largest is quadratic too)."""


def field_error(field: str, reason: str) -> PydanticCustomError:
    """An error on one named field of the model being validated.

    ``mixrl.api.errors`` appends ``field`` to the error location, so messages read
    ``spec.samplerPools[2].weightPrecision: nvfp4 needs FP4 tensor cores, which A100 lacks``.
    """
    return PydanticCustomError("mixrl_field", "{reason}", {"field": field, "reason": reason})


def cel_literal(value: Any) -> str:
    """A Python default or constant as a CEL literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a double-quoted CEL string with the same escapes
    if isinstance(value, list | tuple):
        return "[" + ", ".join(cel_literal(v) for v in value) + "]"
    raise ValueError(f"no CEL literal for {value!r}")


@dataclass(frozen=True)
class Node:
    """One model's schema node as a CEL rule sees it: ``self`` is the object, fields by camelCase name."""

    model: type[BaseModel]
    table: GpuTable

    def _field(self, name: str) -> FieldInfo:
        for python_name, info in self.model.model_fields.items():
            if (info.alias or python_name) == name:
                return info
        raise KeyError(f"{self.model.__name__} has no field {name!r}")

    def default(self, name: str) -> Any:
        """The model's default for a field (PydanticUndefined when it is required)."""
        return self._field(name).get_default(call_default_factory=True)

    def value(self, name: str, on: str = "self") -> str:
        """``self.<name>`` (or ``<on>.<name>``), or the model's default when the field is absent (for
        a field of :data:`DERIVED_DEFAULTS`, the default its sibling fields give it)."""
        derived = DERIVED_DEFAULTS.get((self.model.__name__, name))
        if derived is not None:
            return f"(has({on}.{name}) ? {on}.{name} : {derived(self, on)})"
        default = self.default(name)
        if default is PydanticUndefined:
            return f"{on}.{name}"
        return f"(has({on}.{name}) ? {on}.{name} : {cel_literal(default)})"

    def child(self, name: str) -> Node:
        """The node of a nested model (``parallelism``) or of a list's items (``samplerPools``)."""
        annotation = self._field(name).annotation
        for candidate in (annotation, *typing.get_args(annotation)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                return Node(candidate, self.table)
        raise TypeError(f"{self.model.__name__}.{name} is not a nested model")

    def nested_value(self, name: str, sub: str) -> str:
        """``self.<name>.<sub>`` with the defaults of both levels (a nested object is not defaulted
        by the API server, so ``self.<name>`` may be absent too)."""
        child = self.child(name)
        default = cel_literal(child.default(sub))
        return f"(has(self.{name}) ? {child.value(sub, on=f'self.{name}')} : {default})"

    def gpus_lacking(self, cores: str) -> list[str]:
        """GPU types of the table without ``FP8`` or ``FP4`` tensor cores, in table order."""
        return [gpu_type for gpu_type, gpu in self.table.items() if not gpu.has_cores(cores)]

    def emulated_gpus(self) -> list[str]:
        return [gpu_type for gpu_type, gpu in self.table.items() if gpu.emulated]


def _default_gpus_per_replica(node: Node, on: str) -> str:
    # mixrl.api.gpus.default_gpus, from the same table: none on an emulated type, else one
    return f"({on}.gpuType in {cel_literal(node.emulated_gpus())} ? 0 : 1)"


DERIVED_DEFAULTS: dict[tuple[str, str], Callable[[Node, str], str]] = {
    ("SamplerPoolTemplate", "gpusPerReplica"): _default_gpus_per_replica,
}
"""(model, camelCase field) -> the CEL expression of a default that depends on the object's other
fields: the field is null in the schema (so the API server fills in nothing), and the pydantic
validator and every rule reading it put in the same value."""


def _no_values(node: Node) -> dict[str, str]:
    return {}


def _no_facts(model: Any, table: GpuTable) -> Mapping[str, Any]:
    return {}


@dataclass(frozen=True)
class Rule:
    name: str
    """Stable identifier (tests and error reports name rules by it)."""
    models: tuple[str, ...]
    """Names of the models whose schema nodes carry the rule."""
    field: str
    """camelCase field the problem is reported on, relative to the model (the CEL fieldPath)."""
    template: str
    """The message, with ``{placeholders}`` filled from constants and the offending values."""
    reason: Reason
    condition: Callable[[Node], str | None]
    """CEL expression true for a valid object; None when this GPU table leaves nothing to refuse."""
    holds: Callable[[Any, GpuTable], bool]
    """The same condition in Python, on the model instance (pydantic's validator, :func:`enforce`)."""
    values: Callable[[Node], dict[str, str]] = _no_values
    """Placeholder -> CEL expression of type string (``string(...)`` around an int) giving the value
    the message names."""
    facts: Callable[[Any, GpuTable], Mapping[str, Any]] = _no_facts
    """Placeholder -> the value the message names, from the model instance (``values``' twin)."""
    at: Callable[[Any], str] | None = None
    """A more precise field than ``field`` to report the problem on (``samplerPools[3].name``)."""
    constants: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Placeholders that are the same in every message."""
    unless: tuple[str, ...] = ()
    """Rules that pre-empt this one: the pydantic validator checks them first and reports only theirs,
    so the CEL rule holds whenever one of them fails."""
    server_defaults: tuple[str, ...] = ()
    """Fields the API server must default (see the module docstring) for the condition to hold."""

    def message(self, **values: Any) -> str:
        return self.template.format(**self.constants, **values)

    def error(self, *, at: str | None = None, **values: Any) -> PydanticCustomError:
        """The pydantic error for this rule; ``at`` names a more precise field (``samplerPools[3].name``)."""
        return field_error(at or self.field, self.message(**values))

    def cel_message(self, node: Node) -> dict[str, str]:
        """``message`` when the text is fixed, else a ``messageExpression`` of the same template.

        The expression is one ``"...%s...".format([...])`` call (Kubernetes' CEL strings library):
        the API server estimates its cost from the format string alone, whereas concatenating
        ``string(int)`` or a name picked by ``filter`` adds strings of unknown size, which it
        estimates as request-sized and refuses.
        """
        values = self.values(node)
        pattern, arguments = "", []
        for literal, name, spec, conversion in string.Formatter().parse(self.template):
            pattern += literal.replace("%", "%%")
            if name is None:
                continue
            if spec or conversion:
                raise ValueError(f"{self.name}: placeholders take no format spec in a CEL message")
            if name in self.constants:
                pattern += str(self.constants[name]).replace("%", "%%")
            else:
                pattern += "%s"
                arguments.append(values[name])
        if not arguments:
            return {"message": pattern.replace("%%", "%")}
        return {"messageExpression": f"{json.dumps(pattern)}.format([{', '.join(arguments)}])"}


# ----------------------------------------------------------------------------- sampler pools

POOL = "SamplerPoolTemplate"


OWN_OBJECTS = "the run's own {name} objects"


def _reserved_for(name: str) -> str:
    return SERIES_NAME_REASON if name in RESERVED_SERIES_POOL_NAMES else OWN_OBJECTS.format(name=name)


RESERVED_POOL_NAME = Rule(
    "reserved-pool-name",
    (POOL,),
    "name",
    "'{name}' is reserved for {what}",
    "FieldValueForbidden",
    condition=lambda node: (
        f"!(self.name in {cel_literal(sorted(RESERVED_POOL_NAMES | RESERVED_SERIES_POOL_NAMES))})"
    ),
    values=lambda node: {
        "name": "self.name",
        # _reserved_for's twin: one of two constants, or a format of the (bounded) name
        "what": f"(self.name in {cel_literal(sorted(RESERVED_SERIES_POOL_NAMES))}"
        f" ? {cel_literal(SERIES_NAME_REASON)}"
        f" : {cel_literal(OWN_OBJECTS.replace('{name}', '%s'))}.format([self.name]))",
    },
    holds=lambda pool, table: pool.name not in RESERVED_POOL_NAMES | RESERVED_SERIES_POOL_NAMES,
    facts=lambda pool, table: {"name": pool.name, "what": _reserved_for(pool.name)},
)

LWS_NAME_SUFFIX = "-lws"
"""A multi-node pool's LeaderWorkerSet is ``<run>-<pool>-lws`` and so is the headless Service LWS
makes for it: a pool named ``<other>-lws`` would own the same Service name."""

RESERVED_POOL_SUFFIX = Rule(
    "reserved-pool-suffix",
    (POOL,),
    "name",
    "'{name}' ends in '{suffix}', which names a multi-node pool's LeaderWorkerSet and its Service",
    "FieldValueForbidden",
    condition=lambda node: f"!self.name.endsWith({cel_literal(LWS_NAME_SUFFIX)})",
    values=lambda node: {"name": "self.name"},
    constants={"suffix": LWS_NAME_SUFFIX},
    holds=lambda pool, table: not pool.name.endswith(LWS_NAME_SUFFIX),
    facts=lambda pool, table: {"name": pool.name},
)

REPLICA_BOUNDS = Rule(
    "replica-bounds",
    (POOL, "SamplerPoolSpec"),
    "minReplicas",
    "{min} exceeds maxReplicas {max}",
    "FieldValueInvalid",
    condition=lambda node: f"{node.value('minReplicas')} <= {node.value('maxReplicas')}",
    values=lambda node: {
        "min": f"string({node.value('minReplicas')})",
        "max": f"string({node.value('maxReplicas')})",
    },
    holds=lambda pool, table: pool.min_replicas <= pool.max_replicas,
    facts=lambda pool, table: {"min": pool.min_replicas, "max": pool.max_replicas},
)


def _weights_need(cores: str) -> Rule:
    precisions = [p for p, needed in PRECISION_CORES.items() if needed == cores]

    def condition(node: Node) -> str | None:
        lacking = node.gpus_lacking(cores)
        if not lacking:
            return None
        precision = node.value("weightPrecision")
        return f"!({precision} in {cel_literal(precisions)} && self.gpuType in {cel_literal(lacking)})"

    return Rule(
        f"weights-need-{cores.lower()}",
        (POOL,),
        "weightPrecision",
        WEIGHTS_NEED_CORES,
        "FieldValueForbidden",
        condition=condition,
        holds=lambda pool, table: (
            pool.weight_precision not in precisions or table[pool.gpu_type].has_cores(cores)
        ),
        values=lambda node: {"precision": "self.weightPrecision", "gpu_type": "self.gpuType"},
        facts=lambda pool, table: {"precision": pool.weight_precision, "gpu_type": pool.gpu_type},
        constants={"cores": cores},
    )


WEIGHTS_NEED: dict[str, Rule] = {cores: _weights_need(cores) for cores in ("FP8", "FP4")}
"""Tensor cores -> the rule refusing weight precisions that need them on GPUs without them."""


def _fp8_kv_cache_explicit(node: Node) -> str | None:
    lacking = node.gpus_lacking("FP8")
    if not lacking:
        return None
    return (
        f'!(has(self.kvCacheDtype) && self.kvCacheDtype == "fp8" && self.gpuType in {cel_literal(lacking)})'
    )


def _fp8_kv_cache_default(node: Node) -> str | None:
    # kvCacheDtype defaults to fp8 for low-precision pools (mixrl.api.resolve.default_kv_cache_dtype)
    lacking = node.gpus_lacking("FP8")
    if not lacking:
        return None
    precision = node.value("weightPrecision")
    low = cel_literal(sorted(LOW_PRECISIONS))
    return f"has(self.kvCacheDtype) || !({precision} in {low}) || !(self.gpuType in {cel_literal(lacking)})"


FP8_KV_CACHE = Rule(
    "fp8-kv-cache-needs-fp8",
    (POOL,),
    "kvCacheDtype",
    FP8_KV_CACHE_NEEDS_CORES,
    "FieldValueForbidden",
    condition=_fp8_kv_cache_explicit,
    values=lambda node: {"gpu_type": "self.gpuType"},
    unless=tuple(rule.name for rule in WEIGHTS_NEED.values()),
    holds=lambda pool, table: pool.kv_cache_dtype != "fp8" or table[pool.gpu_type].has_cores("FP8"),
    facts=lambda pool, table: {"gpu_type": pool.gpu_type},
)

DEFAULT_FP8_KV_CACHE = Rule(
    "default-fp8-kv-cache-needs-fp8",
    (POOL,),
    "kvCacheDtype",
    FP8_KV_CACHE_NEEDS_CORES + " (the default for low-precision pools; set bf16)",
    "FieldValueForbidden",
    condition=_fp8_kv_cache_default,
    values=lambda node: {"gpu_type": "self.gpuType"},
    unless=tuple(rule.name for rule in WEIGHTS_NEED.values()),
    holds=lambda pool, table: (
        pool.kv_cache_dtype is not None
        or pool.weight_precision not in LOW_PRECISIONS
        or table[pool.gpu_type].has_cores("FP8")
    ),
    facts=lambda pool, table: {"gpu_type": pool.gpu_type},
)


def _engine_placed(node: Node, engine: str, emulated: bool) -> str | None:
    """CEL: a pool of ``engine`` is on an emulated GPU type (``emulated``) or on a real one; None
    where the table leaves nothing to refuse (no emulated type, and the engine needs a real one)."""
    types = node.emulated_gpus()
    if not types and not emulated:
        return None
    on_emulated = f"self.gpuType in {cel_literal(types)}"
    return f'{node.value("engine")} != "{engine}" || {on_emulated if emulated else f"!({on_emulated})"}'


def _sglang_needs_gpu(node: Node) -> str | None:
    return _engine_placed(node, "sglang", emulated=False)


SGLANG_NEEDS_GPU = Rule(
    "sglang-needs-gpu",
    (POOL,),
    "engine",
    "sglang needs a GPU; use the torch engine for gpuType {gpu_type}",
    "FieldValueForbidden",
    condition=_sglang_needs_gpu,
    values=lambda node: {"gpu_type": "self.gpuType"},
    holds=lambda pool, table: pool.engine != "sglang" or not table[pool.gpu_type].emulated,
    facts=lambda pool, table: {"gpu_type": pool.gpu_type},
)

POOL_NEEDS_GPUS = Rule(
    "gpus-per-replica-on-gpu",
    (POOL,),
    "gpusPerReplica",
    "gpuType {gpu_type} needs at least 1 GPU per replica (0 is for gpuType cpu)",
    "FieldValueInvalid",
    condition=lambda node: (
        f"self.gpuType in {cel_literal(node.emulated_gpus())} || {node.value('gpusPerReplica')} >= 1"
    ),
    values=lambda node: {"gpu_type": "self.gpuType"},
    # null gpusPerReplica is 1 on a GPU type (DERIVED_DEFAULTS)
    holds=lambda pool, table: (
        table[pool.gpu_type].emulated or pool.gpus_per_replica is None or pool.gpus_per_replica >= 1
    ),
    facts=lambda pool, table: {"gpu_type": pool.gpu_type},
)


def _per_node_groups(table: GpuTable) -> dict[int, list[str]]:
    """GPUs per node -> the GPU types (not emulated) with that many, in table order."""
    groups: dict[int, list[str]] = {}
    for gpu_type, gpu in table.items():
        if not gpu.emulated:
            groups.setdefault(gpu.gpus_per_node, []).append(gpu_type)
    return groups


def _per_node_cel(node: Node, on: str = "self") -> str:
    """The pool's (``on``'s) GPU type's GPUs per node as a CEL int (0 on an emulated type)."""
    expression = "0"
    for per_node, types in reversed(_per_node_groups(node.table).items()):
        expression = f"({on}.gpuType in {cel_literal(types)} ? {per_node} : {expression})"
    return expression


def _spans_nodes_cel(node: Node, on: str = "self") -> str:
    """CEL: one replica of the pool ``on`` needs more GPUs than one node of its type has
    (gpus.spans_nodes)."""
    gpus = node.value("gpusPerReplica", on=on)
    emulated = cel_literal(node.emulated_gpus())
    return f"(!({on}.gpuType in {emulated}) && {gpus} > {_per_node_cel(node, on)})"


def _pool_spans_nodes(pool: Any, table: GpuTable) -> bool:
    gpu = table[pool.gpu_type]
    return not gpu.emulated and pool.replica_gpus > gpu.gpus_per_node


REPLICA_WHOLE_NODES = Rule(
    "gpus-per-replica-whole-nodes",
    (POOL,),
    "gpusPerReplica",
    "{gpus} GPUs per replica span nodes of {per_node} {gpu_type} GPUs: a replica across nodes"
    " takes whole nodes, so use a multiple of {per_node}",
    "FieldValueInvalid",
    condition=lambda node: (
        f"!{_spans_nodes_cel(node)} || {node.value('gpusPerReplica')} % {_per_node_cel(node)} == 0"
    ),
    values=lambda node: {
        "gpus": f"string({node.value('gpusPerReplica')})",
        "per_node": f"string({_per_node_cel(node)})",
        "gpu_type": "self.gpuType",
    },
    holds=lambda pool, table: (
        not _pool_spans_nodes(pool, table) or pool.replica_gpus % table[pool.gpu_type].gpus_per_node == 0
    ),
    facts=lambda pool, table: {
        "gpus": pool.replica_gpus,
        "per_node": table[pool.gpu_type].gpus_per_node,
        "gpu_type": pool.gpu_type,
    },
)

MULTI_NODE_NEEDS_SGLANG = Rule(
    "multi-node-replica-needs-sglang",
    (POOL,),
    "engine",
    "a replica of {gpus} {gpu_type} GPUs spans nodes, which only engine sglang does"
    " (the torch engine runs on one node)",
    "FieldValueForbidden",
    condition=lambda node: f'!({_spans_nodes_cel(node)} && {node.value("engine")} == "torch")',
    values=lambda node: {"gpus": f"string({node.value('gpusPerReplica')})", "gpu_type": "self.gpuType"},
    holds=lambda pool, table: not (_pool_spans_nodes(pool, table) and pool.engine == "torch"),
    facts=lambda pool, table: {"gpus": pool.replica_gpus, "gpu_type": pool.gpu_type},
)


def _torch_engine_on_cpu(node: Node) -> str | None:
    return _engine_placed(node, "torch", emulated=True)


TORCH_ENGINE_ON_CPU = Rule(
    "torch-engine-on-cpu",
    (POOL,),
    "gpuType",
    "the torch engine computes on CPU only (it never places the model on a GPU): on gpuType"
    " {gpu_type} its pods would hold GPUs they never use; use gpuType cpu, or engine sglang",
    "FieldValueForbidden",
    condition=_torch_engine_on_cpu,
    values=lambda node: {"gpu_type": "self.gpuType"},
    # Every earlier pool rule a torch pool on a GPU type can break as well (one changed gpuType
    # breaks several): validate reports the first a pool breaks, so the API server must too.
    unless=tuple(
        rule.name
        for rule in (
            RESERVED_POOL_NAME,
            RESERVED_POOL_SUFFIX,
            REPLICA_BOUNDS,
            *WEIGHTS_NEED.values(),
            FP8_KV_CACHE,
            DEFAULT_FP8_KV_CACHE,
            POOL_NEEDS_GPUS,
            REPLICA_WHOLE_NODES,
            MULTI_NODE_NEEDS_SGLANG,
        )
    ),
    holds=lambda pool, table: pool.engine != "torch" or table[pool.gpu_type].emulated,
    facts=lambda pool, table: {"gpu_type": pool.gpu_type},
)


def _toleration_exists_no_value(node: Node) -> str:
    return f'!(has(self.value) && self.value != "") || {node.value("operator")} != "Exists"'


TOLERATION_EXISTS_NO_VALUE = Rule(
    "toleration-exists-has-no-value",
    ("Toleration",),
    "value",
    "must be empty with operator Exists (use operator Equal to match a value)",
    "FieldValueInvalid",
    condition=_toleration_exists_no_value,
    holds=lambda toleration, table: not toleration.value or toleration.operator != "Exists",
)

TOLERATION_EQUAL_NEEDS_KEY = Rule(
    "toleration-equal-needs-key",
    ("Toleration",),
    "key",
    "operator Equal needs a key (an empty key with operator Exists tolerates every taint)",
    "FieldValueInvalid",
    condition=lambda node: f'{node.value("operator")} != "Equal" || (has(self.key) && self.key != "")',
    holds=lambda toleration, table: toleration.operator != "Equal" or bool(toleration.key),
)

# ----------------------------------------------------------------------------- trainer

TRAINER = "TrainerSpec"

TRAINER_NEEDS_GPUS = Rule(
    "gpus-per-node-on-gpu",
    (TRAINER,),
    "gpusPerNode",
    "gpuType {gpu_type} needs at least 1 GPU per node (0 is for gpuType cpu)",
    "FieldValueInvalid",
    condition=lambda node: (
        f"{node.value('gpuType')} in {cel_literal(node.emulated_gpus())} || {node.value('gpusPerNode')} >= 1"
    ),
    values=lambda node: {"gpu_type": node.value("gpuType")},
    holds=lambda trainer, table: table[trainer.gpu_type].emulated or trainer.gpus_per_node >= 1,
    facts=lambda trainer, table: {"gpu_type": trainer.gpu_type},
)


def _world(node: Node) -> str:
    """The trainer's world size as mixrl.api.resolve computes it: nodes x max(gpusPerNode, 1)."""
    gpus = node.value("gpusPerNode")
    return f"({node.value('nodes')} * ({gpus} > 0 ? {gpus} : 1))"


def _divides(node: Node, sizes: tuple[str, ...]) -> str:
    """The product of the parallel sizes divides the world size, one division at a time: the product
    itself of int32 sizes could overflow CEL's int64 (a runtime error at admission)."""
    quotient, checks = _world(node), []
    for size in sizes:
        value = node.nested_value("parallelism", size)
        checks.append(f"{quotient} % {value} == 0")
        quotient = f"{quotient} / {value}"
    return " && ".join(checks)


def _parallel_values(node: Node) -> dict[str, str]:
    values = {size: f"string({node.nested_value('parallelism', size)})" for size in ("tp", "pp", "cp", "ep")}
    return {**values, "world": f"string({_world(node)})"}


def _python_divides(trainer: Any, sizes: tuple[str, ...]) -> bool:
    world: int = trainer.nodes * trainer.processes_per_node  # resolve()'s world size
    product: int = math.prod(getattr(trainer.parallelism, size) for size in sizes)
    return world % product == 0


def _parallel_facts(trainer: Any, table: GpuTable) -> dict[str, int]:
    sizes = {size: getattr(trainer.parallelism, size) for size in ("tp", "pp", "cp", "ep")}
    return {**sizes, "world": trainer.nodes * trainer.processes_per_node}


PARALLELISM_DIVIDES = Rule(
    "parallelism-divides-gpus",
    (TRAINER,),
    "parallelism",
    "tp x pp x cp ({tp} x {pp} x {cp}) must divide the trainer's world size {world} (nodes x gpusPerNode)",
    "FieldValueInvalid",
    condition=lambda node: _divides(node, ("tp", "pp", "cp")),
    values=_parallel_values,
    unless=(TRAINER_NEEDS_GPUS.name,),
    holds=lambda trainer, table: _python_divides(trainer, ("tp", "pp", "cp")),
    facts=_parallel_facts,
)

EXPERT_PARALLELISM_DIVIDES = Rule(
    "expert-parallelism-divides-gpus",
    (TRAINER,),
    "parallelism.ep",
    # Megatron carves the expert-parallel groups out of the data- and context-parallel ranks, with the
    # experts' tensor-parallel size defaulting to tp: world % (tp x ep x pp) == 0.
    "tp x pp x ep ({tp} x {pp} x {ep}) must divide the trainer's world size {world} (nodes x gpusPerNode)",
    "FieldValueInvalid",
    condition=lambda node: _divides(node, ("tp", "pp", "ep")),
    values=_parallel_values,
    unless=(TRAINER_NEEDS_GPUS.name, PARALLELISM_DIVIDES.name),
    holds=lambda trainer, table: _python_divides(trainer, ("tp", "pp", "ep")),
    facts=_parallel_facts,
)

MODEL_PATH_IS_LOCAL = Rule(
    "model-path-is-local",
    ("ModelSpec",),
    "path",
    "must be a directory the trainer can read (a mounted volume) or tiny:<kind>: the trainer loads "
    "it with transformers from local files and downloads nothing (no s3://, hf:// or https:// URLs)",
    "FieldValueInvalid",
    condition=lambda node: f"!{node.value('path')}.matches('{URL_SCHEME}')",
    holds=lambda model, table: not re.match(URL_SCHEME, model.path),
)

TINY_KIND_KNOWN = Rule(
    "tiny-model-kind-known",
    ("ModelSpec",),
    "path",
    "{path} is not a tiny model mixrl builds: expected one of "
    + ", ".join(f"tiny:{kind}" for kind in TINY_KINDS),
    "FieldValueInvalid",
    condition=lambda node: (
        f"!{node.value('path')}.startsWith('tiny:')"
        f" || {node.value('path')} in {cel_literal([f'tiny:{kind}' for kind in TINY_KINDS])}"
    ),
    values=lambda node: {"path": node.value("path")},
    holds=lambda model, table: tiny_kind(model.path) in (None, *TINY_KINDS),
    facts=lambda model, table: {"path": model.path},
)

_TINY_TOKENIZES = "a tiny: model uses mixrl's word tokenizer, which renders chats itself"

TINY_OWN_TOKENIZER = Rule(
    "tiny-model-own-tokenizer",
    ("ModelSpec",),
    "tokenizer",
    f"{_TINY_TOKENIZES}: leave tokenizer out",
    "FieldValueForbidden",
    condition=lambda node: "!(self.path.startsWith('tiny:') && has(self.tokenizer))",
    unless=(TINY_KIND_KNOWN.name,),
    holds=lambda model, table: tiny_kind(model.path) is None or model.tokenizer is None,
)

TINY_OWN_CHAT_TEMPLATE = Rule(
    "tiny-model-own-chat-template",
    ("ModelSpec",),
    "chatTemplate",
    f"{_TINY_TOKENIZES}: leave chatTemplate out",
    "FieldValueForbidden",
    condition=lambda node: "!(self.path.startsWith('tiny:') && has(self.chatTemplate))",
    unless=(TINY_KIND_KNOWN.name, TINY_OWN_TOKENIZER.name),
    holds=lambda model, table: tiny_kind(model.path) is None or model.chat_template is None,
)

STORE_IS_A_PATH = Rule(
    "weight-store-is-a-path",
    ("WeightsSpec",),
    "store",
    "must be an absolute path or a file:/// URL (the trainer and the engines share it as a volume"
    " mounted there: a relative path would name each container's own working directory); object"
    " stores such as s3:// have no storage backend yet",
    "FieldValueInvalid",
    condition=lambda node: (
        f"{node.value('store')}.startsWith('/') || {node.value('store')}.startsWith('file:///')"
    ),
    holds=lambda weights, table: weights.store.startswith(("/", "file:///")),
)


def _store_off_pod_dirs(node: Node) -> str:
    store = node.nested_value("weights", "store")
    clashes = [f"{store} == '/'", f"{store} == 'file:///'"]  # the root: every directory is below it
    for directory in POD_DIRS:
        for form in (directory, f"file://{directory}"):
            clashes += [f"{store} == '{form}'", f"{store}.startsWith('{form}/')"]
    return "!(" + " || ".join(clashes) + ")"


STORE_OFF_POD_DIRS = Rule(
    "weight-store-off-pod-directories",
    # On the run's spec, not on WeightsSpec: a resolved run of `mixrl run` carries its own store
    # (under the run directory, /tmp or anywhere), which no pod mounts.
    ("RLRunSpec",),
    "weights.store",
    "{store} is the root or lies in a directory where the pods mount a volume of their own ("
    + ", ".join(POD_DIRS)
    + "): the weights volume mounted there would collide with it; choose another directory"
    " (the default is /var/lib/mixrl/weights)",
    "FieldValueInvalid",
    condition=_store_off_pod_dirs,
    values=lambda node: {"store": node.nested_value("weights", "store")},
    holds=lambda spec, table: colliding_dir(spec.weights.store) is None,
    facts=lambda spec, table: {"store": spec.weights.store},
)

MEGATRON_NEEDS_GPUS = Rule(
    "megatron-backend-needs-gpus",
    (TRAINER,),
    "backend",
    "backend megatron trains on CUDA GPUs only (megatron-core); gpuType {gpu_type} needs backend torch",
    "FieldValueForbidden",
    condition=lambda node: (
        f"{node.value('backend')} != 'megatron' || !({node.value('gpuType')} in {cel_literal(node.emulated_gpus())})"
    ),
    values=lambda node: {"gpu_type": node.value("gpuType")},
    unless=(TRAINER_NEEDS_GPUS.name, PARALLELISM_DIVIDES.name, EXPERT_PARALLELISM_DIVIDES.name),
    holds=lambda trainer, table: trainer.backend != "megatron" or not table[trainer.gpu_type].emulated,
    facts=lambda trainer, table: {"gpu_type": trainer.gpu_type},
)

MEGATRON_NO_CONTEXT_PARALLEL = Rule(
    "megatron-backend-without-context-parallelism",
    (TRAINER,),
    "parallelism",
    "the megatron backend does not support context parallelism yet: cp must be 1",
    "FieldValueInvalid",
    condition=lambda node: (
        f"{node.value('backend')} != 'megatron' || {node.nested_value('parallelism', 'cp')} == 1"
    ),
    unless=(TRAINER_NEEDS_GPUS.name, PARALLELISM_DIVIDES.name, EXPERT_PARALLELISM_DIVIDES.name),
    holds=lambda trainer, table: trainer.backend != "megatron" or trainer.parallelism.cp == 1,
)

TORCH_IS_DATA_PARALLEL = Rule(
    "torch-backend-is-data-parallel",
    (TRAINER,),
    "parallelism",
    "the torch backend is data parallel (FSDP2): tp, pp, ep and cp must be 1 "
    "(tensor, pipeline, expert and context parallelism need the megatron backend)",
    "FieldValueInvalid",
    condition=lambda node: (
        f"{node.value('backend')} != 'torch' || ("
        + " && ".join(f"{node.nested_value('parallelism', size)} == 1" for size in ("tp", "pp", "ep", "cp"))
        + ")"
    ),
    unless=(TRAINER_NEEDS_GPUS.name, PARALLELISM_DIVIDES.name, EXPERT_PARALLELISM_DIVIDES.name),
    holds=lambda trainer, table: (
        trainer.backend != "torch"
        or all(getattr(trainer.parallelism, size) == 1 for size in ("tp", "pp", "ep", "cp"))
    ),
)

# ----------------------------------------------------------------------------- algorithm

BETAS = Rule(
    "betas-in-unit-interval",
    ("OptimizerSpec",),
    "betas",
    "each beta must be in [0, 1)",
    "FieldValueInvalid",
    condition=lambda node: "!has(self.betas) || self.betas.all(b, 0.0 <= b && b < 1.0)",
    holds=lambda optimizer, table: all(0.0 <= b < 1.0 for b in optimizer.betas),
)

TOP_K = Rule(
    "top-k-nonzero",
    ("TopPSpec",),
    "k",
    "k must be -1 (no cut) or positive",
    "FieldValueInvalid",
    condition=lambda node: "!has(self.k) || self.k != 0",
    holds=lambda top_p, table: top_p.k != 0,
)

GRPO_GROUPS = Rule(
    "grpo-groups-of-two",
    ("AlgorithmSpec",),
    "samplesPerPrompt",
    "GRPO needs at least 2 samples per prompt: a group of one has advantage 0 (its reward minus its"
    " own mean) and no standard deviation, so nothing would be learned",
    "FieldValueInvalid",
    condition=lambda node: "!has(self.samplesPerPrompt) || self.samplesPerPrompt >= 2",
    holds=lambda algorithm, table: algorithm.samples_per_prompt >= 2,
)

MIS_RANGE = Rule(
    "mis-range",
    ("CorrectionsSpec",),
    "mis",
    "range [lo, hi] must satisfy 0 < lo < 1 < hi",
    "FieldValueInvalid",
    condition=lambda node: "!has(self.mis) || (0.0 < self.mis[0] && self.mis[0] < 1.0 && 1.0 < self.mis[1])",
    holds=lambda corrections, table: (
        corrections.mis is None or 0 < corrections.mis[0] < 1 < corrections.mis[1]
    ),
)

MIS_OR_TIS = Rule(
    "mis-or-tis",
    ("CorrectionsSpec",),
    "tis",
    "choose one of mis and tis, not both",
    "FieldValueForbidden",
    # mis is on unless set to null: the API server fills in the default, so has() means "on"
    condition=lambda node: "!(has(self.tis) && has(self.mis))",
    server_defaults=("mis",),
    holds=lambda corrections, table: corrections.mis is None or corrections.tis is None,
)

# ----------------------------------------------------------------------------- evaluation

PASS_K_POSITIVE = Rule(
    "pass-k-positive",
    ("EvaluationSpec",),
    "passK",
    "every k must be positive, got {k}",
    "FieldValueInvalid",
    condition=lambda node: "!has(self.passK) || self.passK.all(k, k > 0)",
    values=lambda node: {"k": "string(self.passK.filter(k, k <= 0)[0])"},
    holds=lambda evaluation, table: all(k > 0 for k in evaluation.pass_k),
    facts=lambda evaluation, table: {"k": next(k for k in evaluation.pass_k if k <= 0)},
)


def _largest_pass_k(node: Node) -> str:
    pass_k = node.value("passK")
    return f"{pass_k}.filter(k, {pass_k}.all(j, j <= k))[0]"


SAMPLES_COVER_PASS_K = Rule(
    "samples-cover-pass-k",
    ("EvaluationSpec",),
    "samplesPerTask",
    "{samples} is below the largest passK {k}",
    "FieldValueInvalid",
    condition=lambda node: f"{node.value('passK')}.all(k, k <= {node.value('samplesPerTask')})",
    values=lambda node: {
        "samples": f"string({node.value('samplesPerTask')})",
        "k": f"string({_largest_pass_k(node)})",
    },
    unless=(PASS_K_POSITIVE.name,),
    holds=lambda evaluation, table: all(k <= evaluation.samples_per_task for k in evaluation.pass_k),
    facts=lambda evaluation, table: {"samples": evaluation.samples_per_task, "k": max(evaluation.pass_k)},
)

# ----------------------------------------------------------------------------- the run

UNIQUE_POOL_NAMES = Rule(
    "unique-pool-names",
    ("RLRunSpec",),
    "samplerPools",
    "duplicate pool name '{name}'",
    "FieldValueInvalid",
    condition=lambda node: "self.samplerPools.all(p, self.samplerPools.exists_one(q, q.name == p.name))",
    # the first pool (in list order) whose name is not unique, as the pydantic validator reports it
    values=lambda node: {
        "name": "self.samplerPools.filter(p, !self.samplerPools.exists_one(q, q.name == p.name))[0].name"
    },
    holds=lambda spec, table: _duplicate_pool(spec) is None,
    facts=lambda spec, table: {"name": spec.sampler_pools[_duplicate_pool(spec)].name},
    at=lambda spec: f"samplerPools[{_duplicate_pool(spec)}].name",
)


def _duplicate_pool(spec: Any) -> int | None:
    """The index of the second occurrence of the first pool name (in list order) that is not unique:
    where the problem is reported; the CEL twin names the same pool."""
    names = [pool.name for pool in spec.sampler_pools]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    return None if duplicate is None else names.index(duplicate, names.index(duplicate) + 1)


def _minimums(spec: Any) -> int:
    """GPUs the pools' minimums hold (the autoscaler counts every pool alike)."""
    return sum(pool.min_replicas * pool.replica_gpus for pool in spec.sampler_pools)


def _pool_minimums(node: Node) -> str:
    pool = node.child("samplerPools")
    return f"self.samplerPools.map(p, {pool.value('minReplicas', on='p')} * {pool.value('gpusPerReplica', on='p')}).sum()"


GPU_BUDGET_COVERS_MINIMUMS = Rule(
    "gpu-budget-covers-minimums",
    ("RLRunSpec",),
    "autoscaling.gpuBudget",
    "{budget} GPUs cannot hold the pools' minimums: minReplicas x gpusPerReplica sum to {need}",
    "FieldValueInvalid",
    # gpusPerReplica <= 64 and 32 pools keep the sum far from int64 (the API server's CEL overflows)
    condition=lambda node: (
        "!has(self.autoscaling) || !has(self.autoscaling.gpuBudget)"
        f" || {_pool_minimums(node)} <= self.autoscaling.gpuBudget"
    ),
    values=lambda node: {
        "budget": "string(self.autoscaling.gpuBudget)",
        "need": f"string({_pool_minimums(node)})",
    },
    holds=lambda spec, table: (
        spec.autoscaling.gpu_budget is None or _minimums(spec) <= spec.autoscaling.gpu_budget
    ),
    facts=lambda spec, table: {"budget": spec.autoscaling.gpu_budget, "need": _minimums(spec)},
)


def _sglang_mask_needs_top_k(node: Node) -> str:
    # Absent algorithm, topP or p: p = 1 (no truncation); absent k: -1 (no cut).  The schema bounds
    # k at -1, and k = 0 is top-k-nonzero's to report, so "no cut" is exactly k == -1.
    pool = node.child("samplerPools")
    top_p = "self.algorithm.topP"
    return (
        f"!has(self.algorithm) || !has({top_p}) || !has({top_p}.p) || {top_p}.p >= 1.0"
        f" || (has({top_p}.k) && {top_p}.k != -1)"
        f' || !self.samplerPools.exists(q, {pool.value("engine", on="q")} == "sglang")'
    )


SGLANG_MASK_NEEDS_TOP_K = Rule(
    "sglang-mask-needs-top-k",
    ("RLRunSpec",),
    "algorithm.topP.k",
    "top-p below 1 needs a positive k on SGLang pools: SGLang returns the sampling support only"
    " under a finite top-k and aborts the request otherwise (or run every pool on the torch engine)",
    "FieldValueInvalid",
    condition=_sglang_mask_needs_top_k,
    # SGLang's sampling mask needs a finite top-k (SamplingRule.mask_limit)
    holds=lambda spec, table: (
        spec.algorithm.top_p.p >= 1.0
        or spec.algorithm.top_p.k != -1
        or all(pool.engine != "sglang" for pool in spec.sampler_pools)
    ),
)

_KEDA_PER_POOL = "KEDA scales each pool from its own query"
_NONE_SCALES_NOTHING = "none scales nothing"

TRAINER_OBJECTIVE_NEEDS_BUILTIN = Rule(
    "trainer-objective-needs-builtin",
    ("RLRunSpec",),
    "autoscaling.objective",
    "trainer sizes the whole fleet in mixrl's own loop and needs engine builtin, not {engine} ({why})",
    "FieldValueForbidden",
    condition=lambda node: (
        "!has(self.autoscaling) || !has(self.autoscaling.objective)"
        " || self.autoscaling.objective != 'trainer'"
        " || (has(self.autoscaling.engine) ? self.autoscaling.engine : 'builtin') == 'builtin'"
    ),
    values=lambda node: {
        "engine": "(has(self.autoscaling.engine) ? self.autoscaling.engine : 'builtin')",
        # The rule refuses keda and none; each has its own reason.
        "why": (
            "((has(self.autoscaling.engine) ? self.autoscaling.engine : 'builtin') == 'keda'"
            f" ? '{_KEDA_PER_POOL}' : '{_NONE_SCALES_NOTHING}')"
        ),
    },
    holds=lambda spec, table: spec.autoscaling.objective != "trainer" or spec.autoscaling.engine == "builtin",
    facts=lambda spec, table: {
        "engine": spec.autoscaling.engine,
        "why": _KEDA_PER_POOL if spec.autoscaling.engine == "keda" else _NONE_SCALES_NOTHING,
    },
)

GPU_BUDGET_NEEDS_BUILTIN = Rule(
    "gpu-budget-needs-builtin",
    ("RLRunSpec",),
    "autoscaling.gpuBudget",
    "a GPU budget shared by the pools is kept by mixrl's own loop and needs engine builtin, not"
    " {engine} (KEDA scales each pool on its own; none scales nothing)",
    "FieldValueForbidden",
    condition=lambda node: (
        "!has(self.autoscaling) || !has(self.autoscaling.gpuBudget)"
        " || (has(self.autoscaling.engine) ? self.autoscaling.engine : 'builtin') == 'builtin'"
    ),
    values=lambda node: {"engine": "(has(self.autoscaling.engine) ? self.autoscaling.engine : 'builtin')"},
    # A budget under the minimums, or objective trainer with KEDA, is reported first (as validate does).
    unless=("gpu-budget-covers-minimums", "trainer-objective-needs-builtin"),
    holds=lambda spec, table: spec.autoscaling.gpu_budget is None or spec.autoscaling.engine == "builtin",
    facts=lambda spec, table: {"engine": spec.autoscaling.engine},
)

COST_BUDGET_NEEDS_TRAINER_OBJECTIVE = Rule(
    "cost-budget-needs-trainer-objective",
    ("RLRunSpec",),
    "autoscaling.costBudgetPerHour",
    "only objective trainer plans the fleet by cost; objective {objective} sizes each pool to its"
    " load and would ignore it",
    "FieldValueForbidden",
    condition=lambda node: (
        "!has(self.autoscaling) || !has(self.autoscaling.costBudgetPerHour)"
        " || (has(self.autoscaling.objective) ? self.autoscaling.objective : 'queue') == 'trainer'"
    ),
    values=lambda node: {
        "objective": "(has(self.autoscaling.objective) ? self.autoscaling.objective : 'queue')"
    },
    holds=lambda spec, table: (
        spec.autoscaling.cost_budget_per_hour is None or spec.autoscaling.objective == "trainer"
    ),
    facts=lambda spec, table: {"objective": spec.autoscaling.objective},
)

WORKERS_HAVE_TASKS = Rule(
    "rollout-workers-have-tasks",
    ("RolloutSpec",),
    "workers",
    "{workers} workers each play their own shard of the training split, and trainSize {tasks} leaves"
    " some of them none: at most trainSize workers",
    "FieldValueInvalid",
    condition=lambda node: f"{node.value('workers')} <= {node.nested_value('dataset', 'trainSize')}",
    values=lambda node: {
        "workers": f"string({node.value('workers')})",
        "tasks": f"string({node.nested_value('dataset', 'trainSize')})",
    },
    holds=lambda rollout, table: rollout.workers <= rollout.dataset.train_size,
    facts=lambda rollout, table: {"workers": rollout.workers, "tasks": rollout.dataset.train_size},
)

RUN_NAME_LENGTH = Rule(
    "run-name-length",
    ("RLRun",),
    "metadata.name",
    "at most {limit} characters (children are <run>-<pool>)",
    "FieldValueInvalid",
    condition=lambda node: f"self.metadata.name.size() <= {MAX_RUN_NAME}",
    constants={"limit": MAX_RUN_NAME},
    holds=lambda run, table: len(run.metadata.name) <= MAX_RUN_NAME,
)

MULTI_NODE_NAME_MAX = 46
"""``<run>-<pool>`` of a pool whose replica spans nodes: LeaderWorkerSet ``<run>-<pool>-lws`` names
each group's StatefulSet ``<lws>-<group>`` and labels its revisions ``<that>-<hash of 10>``, a
label value of at most 63 characters."""


def _multi_node_pools(node: Node) -> str:
    return (
        f"self.spec.samplerPools.filter(p, {_spans_nodes_cel(node.child('spec').child('samplerPools'), 'p')})"
    )


def _long_multi_node_pool(run: Any, table: GpuTable) -> int | None:
    """The index of the first pool spanning nodes whose ``<run>-<pool>`` is too long (None: none)."""
    for index, pool in enumerate(run.spec.sampler_pools):
        if (
            _pool_spans_nodes(pool, table)
            and len(run.metadata.name) + 1 + len(pool.name) > MULTI_NODE_NAME_MAX
        ):
            return index
    return None


MULTI_NODE_NAME_LENGTH = Rule(
    "multi-node-pool-name-length",
    ("RLRun",),
    "metadata.name",
    "'<run>-<pool>' of pool '{pool}', whose replica spans nodes, must be at most {limit} characters"
    " (its LeaderWorkerSet's revision labels are '<run>-<pool>-lws-<group>-<hash>'): shorten the run"
    " or the pool name",
    "FieldValueInvalid",
    condition=lambda node: (
        f"{_multi_node_pools(node)}.all(p, self.metadata.name.size() + 1 + p.name.size() <= {MULTI_NODE_NAME_MAX})"
    ),
    values=lambda node: {
        "pool": (
            f"{_multi_node_pools(node)}.filter(p, self.metadata.name.size() + 1 + p.name.size()"
            f" > {MULTI_NODE_NAME_MAX})[0].name"
        )
    },
    constants={"limit": MULTI_NODE_NAME_MAX},
    unless=("run-name-length",),
    holds=lambda run, table: _long_multi_node_pool(run, table) is None,
    facts=lambda run, table: {"pool": run.spec.sampler_pools[_long_multi_node_pool(run, table)].name},
)

RULES: tuple[Rule, ...] = (
    MODEL_PATH_IS_LOCAL,
    TINY_KIND_KNOWN,
    TINY_OWN_TOKENIZER,
    TINY_OWN_CHAT_TEMPLATE,
    STORE_IS_A_PATH,
    RESERVED_POOL_NAME,
    RESERVED_POOL_SUFFIX,
    REPLICA_BOUNDS,
    *WEIGHTS_NEED.values(),
    FP8_KV_CACHE,
    DEFAULT_FP8_KV_CACHE,
    SGLANG_NEEDS_GPU,
    POOL_NEEDS_GPUS,
    REPLICA_WHOLE_NODES,
    MULTI_NODE_NEEDS_SGLANG,
    TORCH_ENGINE_ON_CPU,
    TOLERATION_EXISTS_NO_VALUE,
    TOLERATION_EQUAL_NEEDS_KEY,
    TRAINER_NEEDS_GPUS,
    PARALLELISM_DIVIDES,
    EXPERT_PARALLELISM_DIVIDES,
    MEGATRON_NEEDS_GPUS,
    MEGATRON_NO_CONTEXT_PARALLEL,
    TORCH_IS_DATA_PARALLEL,
    BETAS,
    TOP_K,
    GRPO_GROUPS,
    MIS_RANGE,
    MIS_OR_TIS,
    PASS_K_POSITIVE,
    SAMPLES_COVER_PASS_K,
    UNIQUE_POOL_NAMES,
    GPU_BUDGET_COVERS_MINIMUMS,
    TRAINER_OBJECTIVE_NEEDS_BUILTIN,
    GPU_BUDGET_NEEDS_BUILTIN,
    WORKERS_HAVE_TASKS,
    COST_BUDGET_NEEDS_TRAINER_OBJECTIVE,
    SGLANG_MASK_NEEDS_TOP_K,
    STORE_OFF_POD_DIRS,
    RUN_NAME_LENGTH,
    MULTI_NODE_NAME_LENGTH,
)
"""Every rule, in the order each model's validator checks them."""


def _negate(expression: str) -> str:
    """``!(expression)``, or the inside of an expression that is one negated group already."""
    if expression.startswith("!(") and expression.endswith(")"):
        depth, quoted = 0, False
        for index, char in enumerate(expression[1:], start=1):
            if char == '"' and expression[index - 1] != "\\":
                quoted = not quoted
            if quoted:
                continue
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                if index == len(expression) - 1:  # the group closes at the very end: it is all of it
                    return expression[2:-1]
                break
    return f"!({expression})"


def rules_for(model: type[BaseModel]) -> list[Rule]:
    return [rule for rule in RULES if model.__name__ in rule.models]


def _check_order(rules: tuple[Rule, ...]) -> dict[str, tuple[Rule, ...]]:
    """Model name -> its rules in order, refusing an ``unless`` that does not come first: the Python
    side reports the first broken rule, so a pre-empting rule must be checked before the one it
    pre-empts, on the same model, for both sides to report the same one."""
    seen: dict[str, set[str]] = {}
    by_model: dict[str, list[Rule]] = {}
    for rule in rules:
        for model in rule.models:
            missing = [name for name in rule.unless if name not in seen.get(model, set())]
            if missing:
                raise ValueError(f"rule {rule.name}: {missing} must come before it on {model}")
            seen.setdefault(model, set()).add(rule.name)
            by_model.setdefault(model, []).append(rule)
    return {model: tuple(model_rules) for model, model_rules in by_model.items()}


RULES_BY_MODEL = _check_order(RULES)


def enforce(instance: BaseModel, table: GpuTable) -> None:
    """Raise the error of the first rule the instance breaks: the pydantic side of every rule, run by
    :class:`mixrl.api.models.Model`'s validator for each model a rule names."""
    for rule in RULES_BY_MODEL.get(type(instance).__name__, ()):
        if not rule.holds(instance, table):
            at = rule.at(instance) if rule.at is not None else None
            raise rule.error(at=at, **rule.facts(instance, table))


def cel_validations(model: type[BaseModel], table: GpuTable = GPU_TABLE) -> list[dict[str, str]]:
    """The ``x-kubernetes-validations`` of one model's schema node."""
    node = Node(model, table)
    rules = rules_for(model)
    conditions = {rule.name: rule.condition(node) for rule in rules}
    validations = []
    for rule in rules:
        condition = conditions[rule.name]
        if condition is None:
            continue
        first = [c for name in rule.unless if (c := conditions.get(name))]
        if first:
            condition = " || ".join([f"({condition})", *(f"({_negate(c)})" for c in first)])
        validations.append(
            {
                "rule": condition,
                **rule.cel_message(node),
                "fieldPath": f".{rule.field}",
                "reason": rule.reason,
            }
        )
    return validations


def server_defaults(model: type[BaseModel]) -> dict[str, Any]:
    """camelCase field -> the default the CRD must carry for this model's rules (JSON values)."""
    node = Node(model, GPU_TABLE)
    defaults: dict[str, Any] = {}
    for rule in rules_for(model):
        for name in rule.server_defaults:
            default = node.default(name)
            defaults[name] = list(default) if isinstance(default, tuple) else default
    return defaults
