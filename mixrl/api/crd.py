"""CustomResourceDefinitions generated from the pydantic models (as kubebuilder generates them from Go).

Kubernetes requires *structural* schemas: no ``$ref``, a ``type`` on every node, ``nullable``
instead of ``anyOf`` with null, OpenAPI v3.0 (boolean ``exclusiveMinimum``), and no
``additionalProperties`` beside ``properties``.  This module turns pydantic's JSON Schema into that,
and gives each model's node the CEL ``x-kubernetes-validations`` of its cross-field rules
(:mod:`mixrl.api.rules`), so the API server refuses at admission what ``mixrl validate`` refuses.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import yaml

from mixrl.api import rules
from mixrl.api.base import Model
from mixrl.api.gpus import GPU_TABLE
from mixrl.api.models import (
    GROUP,
    VERSION,
    RLRun,
    RLRunSpec,
    SamplerPool,
    SamplerPoolSpec,
)
from mixrl.api.plain_text import plain_text
from mixrl.api.rules import GpuTable
from mixrl.api.status import RLRunStatus, SamplerPoolStatus

CATEGORY = "mixrl"
Schema = dict[str, Any]

# Lists whose items have a unique name: server-side apply and strategic merges key them by it.
LIST_MAP_KEYS = {"samplerPools": "name", "pools": "name", "conditions": "type"}
# Which model a JSON-Schema node came from (pydantic names each $defs entry after its class), so the
# node gets that model's rules; dropped from the output.
MODEL_MARK = "x-mixrl-model"


def _models(base: type[Model] = Model) -> dict[str, type[Model]]:
    found: dict[str, type[Model]] = {}
    for model in base.__subclasses__():
        found[model.__name__] = model
        found.update(_models(model))
    return found


def _resolve_refs(node: Any, defs: dict[str, Schema]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            target = {**copy.deepcopy(defs[name]), MODEL_MARK: name}
            extra = {k: v for k, v in node.items() if k != "$ref"}
            return _resolve_refs({**target, **extra}, defs)
        return {key: _resolve_refs(value, defs) for key, value in node.items()}
    if isinstance(node, list):
        return [_resolve_refs(item, defs) for item in node]
    return node


def _describe_default(description: str, default: Any) -> str:
    if default is None or default == [] or default == {}:
        return description
    return f"{description} Default: {json.dumps(default)}.".strip()


def _with_rules(out: Schema, model: type[Model], table: GpuTable) -> Schema:
    """A model's object node with its CEL rules, and the defaults those rules need the API server to
    apply (see mixrl.api.rules)."""
    for field, default in rules.server_defaults(model).items():
        out["properties"][field]["default"] = default
    validations = rules.cel_validations(model, table)
    if validations:
        out["x-kubernetes-validations"] = validations
    return out


def _structural(node: Schema, name: str = "", table: GpuTable = GPU_TABLE) -> Schema:
    """One pydantic JSON-Schema node -> one structural OpenAPI v3.0 node."""
    node = dict(node)
    model = _models().get(node.pop(MODEL_MARK, ""))
    description = plain_text(node.pop("description", ""))
    default = node.pop("default", None)
    node.pop("title", None)
    if "properties" in node:
        # extra="forbid" becomes additionalProperties: false, which Kubernetes forbids beside
        # properties; the API server prunes unknown fields instead (and rejects them under
        # kubectl's strict field validation).
        node.pop("additionalProperties", None)
    nullable = False
    if "anyOf" in node:
        variants = node.pop("anyOf")
        options = [o for o in variants if o.get("type") != "null"]
        nullable = len(options) < len(variants)
        if len(options) != 1:
            raise ValueError(f"{name}: unions other than X | None are not structural")
        node = {**options[0], **node}
        node.pop("title", None)
        model = model or _models().get(node.pop(MODEL_MARK, ""))
    out: Schema = {}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    kind = node.get("type")
    if kind == "object" or "properties" in node:
        out["type"] = "object"
        properties = node.get("properties")
        if properties is not None:
            out["properties"] = {key: _structural(value, key, table) for key, value in properties.items()}
            if node.get("required"):
                out["required"] = list(node["required"])
            if model is not None:
                out = _with_rules(out, model, table)
        elif isinstance(node.get("additionalProperties"), dict):
            out["additionalProperties"] = _structural(node["additionalProperties"], name, table)
            if "maxProperties" in node:
                out["maxProperties"] = node["maxProperties"]
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        out["type"] = "array"
        if "prefixItems" in node:
            # A tuple: Kubernetes has no positional schemas, so a fixed-length list of one type.
            items = node["prefixItems"]
            out["items"] = _structural(items[0], name, table)
            out["minItems"] = out["maxItems"] = len(items)
        else:
            out["items"] = _structural(node["items"], name, table)
        for key in ("minItems", "maxItems"):
            if key in node:
                out[key] = node[key]
        if name in LIST_MAP_KEYS:
            out["x-kubernetes-list-type"] = "map"
            out["x-kubernetes-list-map-keys"] = [LIST_MAP_KEYS[name]]
    elif kind in ("string", "integer", "number", "boolean"):
        out["type"] = kind
        for key in ("enum", "pattern", "minLength", "maxLength", "minimum", "maximum", "format"):
            if key in node:
                out[key] = node[key]
        for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if bound in node:  # JSON Schema 2020 number -> OpenAPI 3.0 boolean
                out[plain] = node[bound]
                out[bound] = True
    else:
        raise ValueError(f"{name}: cannot express schema {node} structurally")
    if nullable:
        out["nullable"] = True
    if description:
        out = {"description": _describe_default(description, default), **out}
    return out


def openapi_to_jsonschema(node: Any) -> Any:
    """A CRD's OpenAPI v3.0 schema as JSON Schema (draft 2020-12), so ``jsonschema`` can check a
    manifest against it: ``nullable`` becomes a null type, boolean exclusive bounds become numbers,
    ``x-kubernetes-*`` markers are dropped."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: openapi_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if out.get(bound) is True:
            out[bound] = out.pop(plain)
    if out.pop("nullable", False):
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def structural_schema(model: type[Model], table: GpuTable = GPU_TABLE) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(_resolve_refs({**raw, MODEL_MARK: model.__name__}, defs), table=table)


def _crd(
    kind: str,
    plural: str,
    short_name: str,
    root_model: type[Model],
    spec_model: type[Model],
    status_model: type[Model],
    columns: list[dict[str, Any]],
    description: str,
    scale: dict[str, str] | None = None,
    table: GpuTable = GPU_TABLE,
) -> dict[str, Any]:
    subresources: dict[str, Any] = {"status": {}}
    if scale is not None:
        subresources["scale"] = scale
    schema: Schema = {
        "description": description,
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # Declaring name (the one metadata field a CRD may describe) lets a root rule report
            # on it (fieldPath .metadata.name).
            "metadata": {"type": "object", "properties": {"name": {"type": "string"}}},
            "spec": structural_schema(spec_model, table),
            "status": structural_schema(status_model, table),
        },
        "required": ["spec"],
    }
    validations = rules.cel_validations(root_model, table)
    if validations:
        schema["x-kubernetes-validations"] = validations
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "mixrl", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": [short_name],
                "categories": [CATEGORY],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


def _column(name: str, kind: str, path: str, description: str, priority: int = 0) -> dict[str, Any]:
    column: dict[str, Any] = {
        "name": name,
        "type": kind,
        "jsonPath": path,
        "description": plain_text(description),
    }
    if priority:
        column["priority"] = priority
    return column


AGE = _column("Age", "date", ".metadata.creationTimestamp", "Time since creation")


def rlrun_crd(table: GpuTable = GPU_TABLE) -> dict[str, Any]:
    """The RLRun CRD; ``table`` is the GPU table its precision rules come from."""
    return _crd(
        "RLRun",
        "rlruns",
        "rlr",
        RLRun,
        RLRunSpec,
        RLRunStatus,
        [
            _column("Phase", "string", ".status.phase", "Lifecycle phase"),
            _column("Step", "integer", ".status.step", "Policy updates done"),
            _column("Version", "integer", ".status.weightVersion", "Latest weight version"),
            _column("Pools", "integer", ".status.poolCount", "Sampler pools"),
            _column("Reward", "number", ".status.reward", "Mean training reward at the last step"),
            _column("$/update", "number", ".status.costPerUpdate", "GPU cost per trainer update", priority=1),
            AGE,
        ],
        "An RL run: one BF16 trainer fed asynchronously by sampler pools of mixed GPUs and precisions.",
        table=table,
    )


def samplerpool_crd() -> dict[str, Any]:
    return _crd(
        "SamplerPool",
        "samplerpools",
        "sp",
        SamplerPool,
        SamplerPoolSpec,
        SamplerPoolStatus,
        [
            _column("GPU", "string", ".spec.gpuType", "GPU type"),
            _column("Precision", "string", ".spec.weightPrecision", "Weight precision"),
            _column("Desired", "integer", ".spec.replicas", "Desired replicas"),
            _column("Ready", "integer", ".status.readyReplicas", "Ready replicas"),
            _column("Share", "number", ".status.trafficShare", "Share of the run's sessions"),
            _column("KL", "number", ".status.kl", "Sampler-trainer KL (k3)"),
            _column(
                "Fresh KL", "number", ".status.klFresh", "KL (k3) of fresh (staleness-0) tokens", priority=1
            ),
            _column("Health", "number", ".status.health", "Mismatch-aware routing health", priority=1),
            AGE,
        ],
        "One sampler pool of an RLRun (one GPU type and precision), scalable by kubectl, HPA or KEDA.",
        scale={
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    )


def crd_files() -> dict[str, str]:
    """File name -> YAML text, exactly what ``mixrl crds`` writes."""
    header = "# Generated by `mixrl crds` from mixrl/api/models.py. Do not edit.\n"
    return {
        f"rlruns.{GROUP}.yaml": header + yaml.safe_dump(rlrun_crd(), sort_keys=False, width=100),
        f"samplerpools.{GROUP}.yaml": header + yaml.safe_dump(samplerpool_crd(), sort_keys=False, width=100),
    }
