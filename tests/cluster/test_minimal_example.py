"""examples/rlrun-minimal.yaml as docs/operator.md's "A first run on a real cluster" applies it:
the weights claim created first (the YAML of the docs), the staging Job accepted by the API server
under Pod Security ``restricted``, then the run applied with kubectl and reconciled by the operator
under the chart's RBAC: its one pool's pod scheduled on a node of the pool's GPU product and
Running, the trainer on a node of its GPU type, and the claim left as the user created it.

KWOK runs no container, so the Job's download and the training are not exercised here."""

from __future__ import annotations

import re
from typing import Any

import yaml

from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_RESOURCE, GPU_TABLE
from mixrl.api.models import RLRun

from .conftest import ROOT, Bed, OperatorProcess, wait_for

EXAMPLE = ROOT / "examples" / "rlrun-minimal.yaml"
DOCS = ROOT / "docs" / "operator.md"
SECTION = "## A first run on a real cluster"


def docs_objects() -> dict[str, dict[str, Any]]:
    """Kind -> the object of each YAML block in the docs' first-run section."""
    text = DOCS.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    blocks = re.findall(r"```yaml\n(.*?)```", text[start : end if end != -1 else None], re.DOTALL)
    objects = [yaml.safe_load(block) for block in blocks]
    return {obj["kind"]: obj for obj in objects}


def in_namespace(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    obj["metadata"]["namespace"] = namespace
    return obj


def running(cluster: Bed, namespace: str, selector: str) -> list[dict[str, Any]]:
    items = cluster.get("pods", "-n", namespace, "-l", selector)["items"]
    return [
        p
        for p in items
        if p.get("status", {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def gpus_requested(pod: dict[str, Any]) -> int:
    return sum(
        int(c.get("resources", {}).get("requests", {}).get(GPU_RESOURCE, 0))
        for c in pod["spec"]["containers"]
    )


def test_minimal_example_runs_on_its_gpu_type(
    cluster: Bed, operator: OperatorProcess, namespace: str
) -> None:
    run = in_namespace(yaml.safe_load(EXAMPLE.read_text()), namespace)
    RLRun.model_validate(run)
    name, spec = run["metadata"]["name"], run["spec"]
    (pool,) = spec["samplerPools"]
    documented = docs_objects()
    assert set(documented) == {"PersistentVolumeClaim", "Job"}

    # 1. The claim, as the docs write it: the name and size the run uses (the test bed's default
    # StorageClass, which serves ReadWriteMany, stands in for the docs' RWX class).
    claim = in_namespace(documented["PersistentVolumeClaim"], namespace)
    assert claim["metadata"]["name"] == f"{name}-weights"
    assert claim["spec"]["resources"]["requests"]["storage"] == spec["weights"]["volumeSize"]
    del claim["spec"]["storageClassName"]
    cluster.apply(claim)

    # 2. The staging Job mounts that claim where the run mounts its store and downloads the model to
    # the run's model.path there (the trainer publishes version 0 from it); the
    # API server accepts it with no Pod Security warning at the restricted level.
    job = in_namespace(documented["Job"], namespace)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["BASE"] == spec["model"]["path"]
    (mount,) = container["volumeMounts"]
    assert "file://" + mount["mountPath"] == spec["weights"]["store"]
    assert env["BASE"].startswith(mount["mountPath"] + "/")  # the model lands on the run's volume
    assert pod["volumes"] == [
        {"name": mount["name"], "persistentVolumeClaim": {"claimName": f"{name}-weights"}}
    ]
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/warn=restricted")
    done = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(job))
    assert "created (server dry run)" in done.stdout
    assert "violate" not in done.stderr, done.stderr

    # 3. The run: its one pool's pod on a node of the pool's GPU product, the trainer on its GPU type.
    cluster.apply(run)
    products = {
        n["metadata"]["name"]: n["metadata"]["labels"].get(GPU_PRODUCT_LABEL, "")
        for n in cluster.get("nodes")["items"]
    }
    engines = wait_for(
        lambda: running(
            cluster, namespace, f"app.kubernetes.io/component=sampler,mixrl.dev/pool={pool['name']}"
        ),
        120,
        what="the pool's Running pod",
    )
    assert len(engines) == pool["minReplicas"] == 1
    (engine,) = engines
    assert products[engine["spec"]["nodeName"]] in GPU_TABLE[pool["gpuType"]].gfd_products
    assert gpus_requested(engine) == pool.get("gpusPerReplica", 1)
    trainers = wait_for(
        lambda: running(cluster, namespace, "app.kubernetes.io/component=trainer"), 120, what="the trainer"
    )
    trainer_spec = spec["trainer"]
    assert len(trainers) == trainer_spec["nodes"] == 1
    (trainer,) = trainers
    assert products[trainer["spec"]["nodeName"]] in GPU_TABLE[trainer_spec["gpuType"]].gfd_products
    assert gpus_requested(trainer) == trainer_spec["gpusPerNode"]
    wait_for(
        lambda: (
            cluster.get("sp", f"{name}-{pool['name']}", "-n", namespace)
            .get("status", {})
            .get("readyReplicas")
        ),
        60,
        what="the SamplerPool's ready replica",
        equals=1,
    )

    # Both mount the claim the docs created, and the operator left it the user's: no owner
    # reference (deleting the run keeps the staged weights), the size as created, bound.
    for pod_object in (engine, trainer):
        claims = {
            v["persistentVolumeClaim"]["claimName"]
            for v in pod_object["spec"]["volumes"]
            if "persistentVolumeClaim" in v
        }
        assert f"{name}-weights" in claims
    live = cluster.get("pvc", f"{name}-weights", "-n", namespace)
    assert not live["metadata"].get("ownerReferences")
    assert live["spec"]["resources"]["requests"]["storage"] == spec["weights"]["volumeSize"]
    assert live["status"]["phase"] == "Bound"
