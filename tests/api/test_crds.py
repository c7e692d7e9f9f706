from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from mixrl.api.crd import crd_files, openapi_to_jsonschema, rlrun_crd, samplerpool_crd
from mixrl.api.loader import read_documents

from .conftest import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    nodes = [(path, node)]
    for key, child in node.get("properties", {}).items():
        nodes += walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        nodes += walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        nodes += walk(node["additionalProperties"], f"{path}{{}}")
    return nodes


@pytest.mark.parametrize("crd", [rlrun_crd(), samplerpool_crd()], ids=["rlrun", "samplerpool"])
def test_schemas_are_structural(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    forbidden = {"$ref", "anyOf", "oneOf", "allOf", "prefixItems", "const", "$defs", "title"}
    for path, node in walk(schema):
        assert "type" in node, f"{path}: no type"
        assert not forbidden & set(node), f"{path}: {forbidden & set(node)}"
        assert not ("properties" in node and "additionalProperties" in node), path
        if node.get("type") == "object" and path.count(".") >= 2:
            has_shape = "properties" in node or "additionalProperties" in node
            assert has_shape or node.get("x-kubernetes-preserve-unknown-fields"), path
    for path, node in walk(schema["properties"]["spec"]):
        if path and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"spec{path}: no description for kubectl explain"


def test_subresources_names_and_columns() -> None:
    rlrun, pool = rlrun_crd(), samplerpool_crd()
    assert rlrun["spec"]["names"]["shortNames"] == ["rlr"] and pool["spec"]["names"]["shortNames"] == ["sp"]
    assert rlrun["spec"]["names"]["categories"] == ["mixrl"] == pool["spec"]["names"]["categories"]
    assert rlrun["spec"]["versions"][0]["subresources"] == {"status": {}}
    assert pool["spec"]["versions"][0]["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in rlrun["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns == ["Phase", "Step", "Version", "Pools", "Reward", "$/update", "Age"]
    columns = [c["name"] for c in pool["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns == ["GPU", "Precision", "Desired", "Ready", "Share", "KL", "Fresh KL", "Health", "Age"]
    # every column points at a field the schema has
    for crd in (rlrun, pool):
        version = crd["spec"]["versions"][0]
        paths = {p for p, _ in walk(version["schema"]["openAPIV3Schema"])}
        for column in version["additionalPrinterColumns"]:
            if not column["jsonPath"].startswith(".metadata"):
                assert column["jsonPath"] in paths, column


def test_pool_list_is_keyed_by_name() -> None:
    spec = rlrun_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    pools = spec["properties"]["samplerPools"]
    assert pools["x-kubernetes-list-type"] == "map" and pools["x-kubernetes-list-map-keys"] == ["name"]
    assert "name" in pools["items"]["required"]


def test_committed_crds_match_models() -> None:
    for name, text in crd_files().items():
        assert (ROOT / "crds" / name).read_text() == text, f"crds/{name} is stale: run `mixrl crds`"


def test_crds_check_command(tmp_path: Path) -> None:
    mixrl = [sys.executable, "-m", "mixrl.cli", "crds", "--out", str(tmp_path)]
    assert subprocess.run([*mixrl, "--check"], capture_output=True).returncode == 1  # missing
    assert subprocess.run(mixrl, capture_output=True).returncode == 0
    assert subprocess.run([*mixrl, "--check"], capture_output=True).returncode == 0
    victim = tmp_path / "rlruns.mixrl.dev.yaml"
    victim.write_text(victim.read_text().replace("shortNames", "shortnames"))
    result = subprocess.run([*mixrl, "--check"], capture_output=True, text=True)
    assert result.returncode == 1 and "rlruns.mixrl.dev.yaml: differs from the models" in result.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_examples_validate_against_the_crd_schema(example: Path) -> None:
    schema = openapi_to_jsonschema(rlrun_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    for document in read_documents(example):
        jsonschema.validate(document.data, schema)


def test_crd_schema_rejects_what_the_models_reject() -> None:
    schema = openapi_to_jsonschema(rlrun_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    doc = yaml.safe_load((ROOT / "examples" / "rlrun-homogeneous.yaml").read_text())
    doc["spec"]["samplerPools"][0]["weightPrecision"] = "int4"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)
    doc["spec"]["samplerPools"][0]["weightPrecision"] = "bf16"
    doc["spec"]["algorithm"]["promptsPerUpdate"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)
