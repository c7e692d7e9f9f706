"""The pure builders: every object they produce, checked against Kubernetes' own schemas and the
conventions of DESIGN.md §4.5 (labels, owners, security, GPU scheduling)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from mixrl.api.crd import openapi_to_jsonschema, samplerpool_crd
from mixrl.api.errors import InvalidSpec
from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_RESOURCE, GPU_TABLE, GPU_TYPES
from mixrl.api.loader import load_rlrun, parse_document
from mixrl.api.models import RESERVED_POOL_NAMES, RLRun, SamplerPool
from mixrl.api.resolve import ENGINE_PORT, SGLANG_QUANTIZATION, ResolvedRun, resolve
from mixrl.operator import drain as drain_module
from mixrl.operator import labels as L
from mixrl.operator import weight_sync
from mixrl.operator.keda import pool_scaled_object
from mixrl.operator.resources import (
    CONFIG_HASH_ANNOTATION,
    HASH_ANNOTATION,
    POOL_CONFIG_HASH_LABEL,
    BuildOptions,
    Monitoring,
    Owner,
    clamp_replicas,
    desired_hash,
    pool_children,
    run_objects,
    seed_replicas,
)
from mixrl.rl.buffer import cli as buffer_cli
from mixrl.rl.engine import server as engine_server
from mixrl.rl.rollout import worker as rollout_worker
from mixrl.rl.router import cli as router_cli

from .support import small_run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("rlrun-*.yaml"))
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
RUN_OWNER_UID = "11111111-2222-3333-4444-555555555555"
Obj = dict[str, Any]


def resolved_of(manifest: Obj) -> ResolvedRun:
    run = parse_document(manifest)
    assert isinstance(run, RLRun)
    return resolve(run)


def run_owner(resolved: ResolvedRun) -> Owner:
    return Owner("mixrl.dev/v1alpha1", "RLRun", resolved.name, RUN_OWNER_UID)


def pool_owner(name: str) -> Owner:
    return Owner("mixrl.dev/v1alpha1", "SamplerPool", name, f"uid-{name}")


def everything(resolved: ResolvedRun, options: BuildOptions | None = None) -> list[Obj]:
    """The run's objects plus every pool's Deployment and Service, as the two controllers build them."""
    options = options or BuildOptions()
    objects = run_objects(resolved, run_owner(resolved), options)
    for pool in resolved.pools:
        objects += pool_children(resolved, pool, seed_replicas(pool), pool_owner(pool.object_name), options)
    return objects


def pod_templates(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    return [(o, o["spec"]["template"]) for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def cpu_run() -> Obj:
    """The laptop shape: CPU trainer, one torch-engine pool emulating NVFP4."""
    pool = {
        "name": "emul",
        "gpuType": "cpu",
        "engine": "torch",
        "weightPrecision": "nvfp4",
        "gpusPerReplica": 0,
    }
    manifest = small_run("tiny", pools=[pool])
    manifest["spec"]["trainer"] = {"gpuType": "cpu", "gpusPerNode": 0}
    return manifest


RUNS = {
    path.stem: load_rlrun(path).model_dump(by_alias=True, exclude_none=True, mode="json") for path in EXAMPLES
}
RUNS["small"] = small_run()
RUNS["cpu"] = cpu_run()


@pytest.fixture(params=sorted(RUNS))
def resolved(request: pytest.FixtureRequest) -> ResolvedRun:
    return resolved_of(copy.deepcopy(RUNS[request.param]))


# ----------------------------------------------------------------------------- schema validation


def test_examples_are_present() -> None:
    assert {"rlrun-mixed", "rlrun-homogeneous"} <= set(RUNS)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_builtin_object_passes_the_kubernetes_openapi_schema(
    resolved: ResolvedRun, version: str
) -> None:
    checked = 0
    for obj in everything(resolved, BuildOptions(monitoring=Monitoring.ANNOTATIONS)):
        if obj["apiVersion"].startswith("mixrl.dev/"):
            continue
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    # ConfigMap, Services, StatefulSets, Deployments, (PVC), two per pool
    assert checked >= 8 + 2 * len(resolved.pools)


def test_the_schema_check_rejects_a_misspelt_field(resolved: ResolvedRun) -> None:
    deployment = next(o for o in everything(resolved) if o["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)
    broken = copy.deepcopy(deployment)
    broken["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_sampler_pools_pass_the_generated_crd_schema_and_the_model(resolved: ResolvedRun) -> None:
    schema = openapi_to_jsonschema(samplerpool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    pools = [
        o for o in run_objects(resolved, run_owner(resolved), BuildOptions()) if o["kind"] == "SamplerPool"
    ]
    assert [p["metadata"]["name"] for p in pools] == [p.object_name for p in resolved.pools]
    for obj, pool in zip(pools, resolved.pools, strict=True):
        created = copy.deepcopy(obj)
        created["spec"]["replicas"] = seed_replicas(pool)
        jsonschema.validate(created, schema)
        model = parse_document(created)
        assert isinstance(model, SamplerPool)
        assert (model.spec.run, model.spec.pool, model.spec.weight_precision) == (
            resolved.name,
            pool.name,
            pool.weight_precision,
        )
        assert "replicas" not in obj["spec"], "after creation, replicas belongs to whoever scales the pool"


# ----------------------------------------------------------------------------- labels, owners, names


def test_labels_follow_the_design_on_every_object(resolved: ResolvedRun) -> None:
    components = {"trainer", "sampler", "router", "rollout", "buffer", "run"}
    for obj in everything(resolved):
        labels = obj["metadata"]["labels"]
        assert labels[L.NAME] == "mixrl"
        assert labels[L.INSTANCE] == resolved.name
        assert labels[L.COMPONENT] in components, obj["metadata"]["name"]
        if labels[L.COMPONENT] == "sampler":
            pool = resolved.pool(labels[L.POOL])
            assert (labels[L.GPU_TYPE], labels[L.PRECISION]) == (pool.gpu_type, pool.weight_precision)
        if labels[L.COMPONENT] == "trainer":
            assert labels[L.PRECISION] == "bf16"
        assert len(obj["metadata"]["name"]) <= 63


def test_workload_selectors_match_their_pods_and_services_select_them(resolved: ResolvedRun) -> None:
    objects = everything(resolved)
    for workload, template in pod_templates(objects):
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items()
        # A selector holds nothing the spec may change (it is immutable).
        assert not {L.GPU_TYPE, L.PRECISION} & set(selector)
    services = [o for o in objects if o["kind"] == "Service"]
    workloads = {w["metadata"]["name"]: w for w, _ in pod_templates(objects)}
    for svc in services:
        target = workloads[svc["metadata"]["name"]]
        assert svc["spec"]["selector"] == target["spec"]["selector"]["matchLabels"]
        pod_ports = {
            p["name"] for c in target["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
        }
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= pod_ports


def test_children_are_owned_by_the_run_and_pool_workloads_by_their_sampler_pool(
    resolved: ResolvedRun,
) -> None:
    objects = everything(resolved)
    pool_names = {p.object_name for p in resolved.pools}
    for obj in objects:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["controller"] is True and ref["blockOwnerDeletion"] is True
        is_pool_child = obj["kind"] in ("Deployment", "Service") and obj["metadata"]["name"] in pool_names
        if is_pool_child:
            assert (ref["kind"], ref["name"], ref["uid"]) == (
                "SamplerPool",
                obj["metadata"]["name"],
                f"uid-{obj['metadata']['name']}",
            )
        else:
            assert (ref["kind"], ref["name"], ref["uid"]) == ("RLRun", resolved.name, RUN_OWNER_UID)
        assert obj["metadata"]["namespace"] == resolved.namespace


def test_pool_names_that_collide_with_components_are_rejected_by_the_api() -> None:
    # <run>-<pool> must never be one of the run's own objects: the API reserves every suffix.
    assert set(L.COMPONENT_SUFFIXES) == RESERVED_POOL_NAMES
    for suffix in L.COMPONENT_SUFFIXES:
        with pytest.raises(InvalidSpec) as caught:
            parse_document(small_run(pools=[{"name": suffix, "gpuType": "H100"}]))
        assert caught.value.first_line == (
            f"spec.samplerPools[0].name: {suffix!r} is reserved for the run's own {suffix} objects"
        )


# ----------------------------------------------------------------------------- pod security


def test_every_container_runs_unprivileged(resolved: ResolvedRun) -> None:
    for workload, template in pod_templates(everything(resolved)):
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in spec["containers"] + spec.get("initContainers", []):
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"] == {"drop": ["ALL"]}
            assert ctx["runAsNonRoot"] is True
            sglang = c["name"] == "engine" and c["command"][:3] == ["python3", "-m", "sglang.launch_server"]
            # Only SGLang writes JIT caches to paths we cannot enumerate.
            assert ctx["readOnlyRootFilesystem"] is (not sglang), (workload["metadata"]["name"], c["name"])
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert {"/tmp", "/etc/mixrl"} <= mounts


# ----------------------------------------------------------------------------- GPU scheduling


GPU_KINDS = [gpu for gpu in GPU_TYPES if gpu != "cpu"]


def best_precision(gpu_type: str) -> str:
    gpu = GPU_TABLE[gpu_type]
    return "nvfp4" if gpu.fp4_tensor_cores else "fp8" if gpu.fp8_tensor_cores else "bf16"


@pytest.mark.parametrize("gpu_type", GPU_KINDS)
def test_each_gpu_type_maps_to_its_gfd_products_gpus_and_taint(gpu_type: str) -> None:
    pool = {
        "name": "p",
        "gpuType": gpu_type,
        "weightPrecision": best_precision(gpu_type),
        "gpusPerReplica": 4,
    }
    resolved = resolved_of(small_run(pools=[pool]))
    [_, deployment] = pool_children(resolved, resolved.pools[0], 3, pool_owner("demo-p"), BuildOptions())
    spec = deployment["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [
        {
            "matchExpressions": [
                {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": list(GPU_TABLE[gpu_type].gfd_products)}
            ]
        }
    ]
    assert GPU_TABLE[gpu_type].gfd_products, "every real GPU type has at least one product name"
    engine = spec["containers"][0]
    assert engine["resources"]["limits"] == {GPU_RESOURCE: "4"}
    assert {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["metadata"]["labels"][L.GPU_TYPE] == gpu_type


def test_the_paper_mixed_run_puts_every_pool_on_its_own_gpu_products() -> None:
    resolved = resolved_of(copy.deepcopy(RUNS["rlrun-mixed"]))
    seen = {}
    for pool in resolved.pools:
        [_, deployment] = pool_children(resolved, pool, 1, pool_owner(pool.object_name), BuildOptions())
        spec = deployment["spec"]["template"]["spec"]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        seen[pool.name] = tuple(terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"])
    assert {pool.gpu_type for pool in resolved.pools} == set(GPU_KINDS)
    for pool in resolved.pools:
        assert seen[pool.name] == GPU_TABLE[pool.gpu_type].gfd_products


def test_scheduling_overrides_replace_products_and_add_selectors_tolerations_priority() -> None:
    pool = {
        "name": "p",
        "gpuType": "H100",
        "scheduling": {
            "gpuProducts": ["NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"],
            "nodeSelector": {"pool": "spot"},
            "tolerations": [{"key": "spot", "operator": "Equal", "value": "yes", "effect": "NoExecute"}],
            "priorityClassName": "rl-samplers",
        },
    }
    resolved = resolved_of(small_run(pools=[pool]))
    [_, deployment] = pool_children(resolved, resolved.pools[0], 1, pool_owner("demo-p"), BuildOptions())
    spec = deployment["spec"]["template"]["spec"]
    expression = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert expression["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [
        "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"
    ]
    assert spec["nodeSelector"] == {"pool": "spot"}
    assert spec["tolerations"] == [
        {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
        {"key": "spot", "operator": "Equal", "value": "yes", "effect": "NoExecute"},
    ]
    assert spec["priorityClassName"] == "rl-samplers"
    kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_a_cpu_pool_asks_for_no_gpu_and_no_gpu_node() -> None:
    resolved = resolved_of(cpu_run())
    [_, deployment] = pool_children(resolved, resolved.pools[0], 1, pool_owner("tiny-emul"), BuildOptions())
    spec = deployment["spec"]["template"]["spec"]
    assert "affinity" not in spec and "tolerations" not in spec
    assert "resources" not in spec["containers"][0] or GPU_RESOURCE not in json.dumps(
        spec["containers"][0]["resources"]
    )
    assert not any(v.get("name") == "dshm" for v in spec["volumes"])


# ----------------------------------------------------------------------------- engines


def engine_of(resolved: ResolvedRun, index: int = 0, options: BuildOptions | None = None) -> tuple[Obj, Obj]:
    pool = resolved.pools[index]
    [_, deployment] = pool_children(
        resolved, pool, 1, pool_owner(pool.object_name), options or BuildOptions()
    )
    spec = deployment["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


@pytest.mark.parametrize(
    ("gpu", "precision"), [("B200", "nvfp4"), ("B300", "mxfp4"), ("H200", "fp8"), ("A100", "bf16")]
)
def test_sglang_engines_get_their_precision_flags(gpu: str, precision: str) -> None:
    quantization = SGLANG_QUANTIZATION[precision]  # resolve's table: which checkpoints need a flag
    manifest = small_run(pools=[{"name": "p", "gpuType": gpu, "weightPrecision": precision}])
    manifest["spec"]["algorithm"] = {"topP": {"p": 0.95, "k": 64}}
    resolved = resolved_of(manifest)
    spec, engine = engine_of(resolved)
    command = engine["command"]
    assert command[:3] == ["python3", "-m", "sglang.launch_server"]
    assert command[command.index("--port") + 1] == str(ENGINE_PORT)
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert "--enable-metrics" in command
    if quantization is None:
        assert "--quantization" not in command
    else:
        assert command[command.index("--quantization") + 1] == quantization
    kv = "fp8_e4m3" if precision != "bf16" else "auto"
    assert command[command.index("--kv-cache-dtype") + 1] == kv
    assert command[command.index("--sampling-mask-max-tokens") + 1] == "64"
    assert engine["image"] == resolved.pools[0].image
    # SGLang starts from the converted checkpoint the init container writes.
    (init,) = spec["initContainers"]
    assert init["command"][:2] == ["mixrl", "engine-sync"] and "--once" in init["command"]
    sidecar = spec["containers"][1]
    assert sidecar["name"] == "weight-sync"
    assert sidecar["command"][sidecar["command"].index("--pool") + 1] == "p"


def test_engines_are_probed_on_health_and_drain_before_stopping() -> None:
    options = BuildOptions(drain_seconds=120)
    resolved = resolved_of(small_run())
    spec, engine = engine_of(resolved, options=options)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "engine"}
    assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] >= 600
    hook = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert hook == ["python3", "/etc/mixrl/drain.py", "--port", str(ENGINE_PORT), "--timeout", "120"]
    assert spec["terminationGracePeriodSeconds"] > 120
    config = next(v for v in spec["volumes"] if v["name"] == "config")
    assert config["configMap"]["name"] == "demo-config"
    objects = run_objects(resolved, run_owner(resolved), options)
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    assert config_map["data"]["drain.py"] == Path(drain_module.__file__).read_text()


def test_the_torch_engine_runs_mixrl_with_its_emulated_precision() -> None:
    resolved = resolved_of(cpu_run())
    spec, engine = engine_of(resolved)
    command = engine["command"]
    assert command[:2] == ["mixrl", "engine"]
    args = engine_server.build_parser().parse_args(command[2:])
    assert (args.model_path, args.weight_precision, args.pool) == (
        "/var/lib/mixrl/engine-weights/current",
        "nvfp4",
        "emul",
    )
    assert (args.host, args.port) == ("0.0.0.0", ENGINE_PORT)
    assert [c["name"] for c in spec["initContainers"]] == ["weights-init"]
    assert engine["securityContext"]["readOnlyRootFilesystem"] is True


def command_of(objects: list[Obj], kind: str, name: str) -> list[str]:
    workload = next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)
    command: list[str] = workload["spec"]["template"]["spec"]["containers"][0]["command"]
    return command


def test_component_command_lines_are_accepted_by_the_components_own_parsers() -> None:
    """Each container's command line parses with the real CLI of the component it starts."""
    resolved = resolved_of(small_run())
    objects = run_objects(resolved, run_owner(resolved), BuildOptions())
    router = router_cli.build_parser().parse_args(command_of(objects, "Deployment", "demo-router")[2:])
    assert (str(router.config), router.host, router.port, router.metrics_port) == (
        "/etc/mixrl/run.json",
        "0.0.0.0",
        8000,
        9400,
    )
    buffer = buffer_cli.build_parser().parse_args(command_of(objects, "StatefulSet", "demo-buffer")[2:])
    assert (str(buffer.dir), buffer.port) == ("/var/lib/mixrl/buffer", 8100)
    rollout_command = command_of(objects, "StatefulSet", "demo-rollout")
    assert "$(POD_INDEX)" in rollout_command  # expanded by the kubelet from the pod-index label
    rollout = rollout_worker.build_parser().parse_args(
        [arg.replace("$(POD_INDEX)", "0") for arg in rollout_command[2:]]
    )
    assert (rollout.router, rollout.buffer) == (
        "http://demo-router.rl.svc:8000",
        "http://demo-buffer.rl.svc:8100",
    )
    for pool in resolved.pools:
        [_, deployment] = pool_children(resolved, pool, 1, pool_owner(pool.object_name), BuildOptions())
        containers = deployment["spec"]["template"]["spec"]["containers"]
        for container in [*containers[1:], *deployment["spec"]["template"]["spec"].get("initContainers", [])]:
            sync = weight_sync.build_parser().parse_args(container["command"][2:])
            assert sync.pool == pool.name


def test_the_trainer_command_uses_only_flags_the_trainer_has() -> None:
    """The trainer's parser lives inside its main(); ask the real command for its flags."""
    resolved = resolved_of(small_run())
    command = command_of(
        run_objects(resolved, run_owner(resolved), BuildOptions()), "StatefulSet", "demo-trainer"
    )
    flags = [arg for arg in command[command.index("trainer") + 1 :] if arg.startswith("--")]
    usage = subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "trainer", "--help"], capture_output=True, text=True, timeout=120
    )
    assert usage.returncode == 0, usage.stderr
    # No --router: in a cluster each engine's weight-sync sidecar converts and reloads every version
    # (SGLang pools need the converted checkpoint); the router reload is the local runtime's.
    assert flags == ["--config", "--buffer", "--run-dir", "--metrics-port"]
    assert "--router" in usage.stdout, "the trainer still has the flag: leaving it out is a choice"
    for flag in flags:
        assert flag in usage.stdout, flag


# ----------------------------------------------------------------------------- run-level objects


def test_the_config_map_carries_exactly_the_resolved_run(resolved: ResolvedRun) -> None:
    config_map = next(
        o for o in run_objects(resolved, run_owner(resolved), BuildOptions()) if o["kind"] == "ConfigMap"
    )
    assert ResolvedRun.model_validate_json(config_map["data"]["run.json"]) == resolved


def test_trainer_statefulset_rendezvous_on_pod_zero() -> None:
    resolved = resolved_of(small_run())  # 2 nodes x 8 GPUs of H200
    objects = run_objects(resolved, run_owner(resolved), BuildOptions())
    trainer = next(
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "demo-trainer"
    )
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "demo-trainer")
    assert trainer["spec"]["replicas"] == 2
    assert trainer["spec"]["podManagementPolicy"] == "Parallel"
    assert trainer["spec"]["serviceName"] == "demo-trainer"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    container = trainer["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:4] == ["torchrun", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d"]
    assert "--rdzv-endpoint=demo-trainer-0.demo-trainer.rl.svc:29500" in command
    assert command[command.index("-m") : command.index("-m") + 5] == [
        "-m",
        "mixrl.cli",
        "trainer",
        "--config",
        "/etc/mixrl/run.json",
    ]
    assert container["resources"]["limits"][GPU_RESOURCE] == "8"
    products = trainer["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    values = products["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"
    ]
    assert values[0]["values"] == list(GPU_TABLE["H200"].gfd_products)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert "/weights" in mounts and not mounts["/weights"].get("readOnly")


def test_a_single_cpu_trainer_runs_without_torchrun() -> None:
    resolved = resolved_of(cpu_run())
    trainer = next(
        o for o in run_objects(resolved, run_owner(resolved), BuildOptions()) if o["kind"] == "StatefulSet"
    )
    command = trainer["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["mixrl", "trainer", "--config", "/etc/mixrl/run.json"]
    (claim,) = trainer["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "run"


def test_weights_volume_only_for_filesystem_stores() -> None:
    resolved = resolved_of(small_run())
    pvc = next(
        o
        for o in run_objects(resolved, run_owner(resolved), BuildOptions())
        if o["kind"] == "PersistentVolumeClaim"
    )
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "100Gi"}}}
    _, engine = engine_of(resolved)
    assert {"name": "weights", "mountPath": "/weights", "readOnly": True} in engine["volumeMounts"]
    manifest = small_run()
    manifest["spec"]["weights"] = {"store": "s3://bucket/run"}
    remote = resolved_of(manifest)
    objects = everything(remote)
    assert not any(o["kind"] == "PersistentVolumeClaim" for o in objects)
    assert "persistentVolumeClaim" not in json.dumps([t for _, t in pod_templates(objects)])


def test_monitoring_mode_chooses_podmonitor_or_scrape_annotations() -> None:
    resolved = resolved_of(small_run())
    annotated = everything(resolved, BuildOptions(monitoring=Monitoring.ANNOTATIONS))
    assert not any(o["kind"] == "PodMonitor" for o in annotated)
    for _, template in pod_templates(annotated):
        assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    monitored = everything(resolved, BuildOptions(monitoring=Monitoring.POD_MONITOR))
    (monitor,) = [o for o in monitored if o["kind"] == "PodMonitor"]
    for _, template in pod_templates(monitored):
        assert "prometheus.io/scrape" not in template["metadata"]["annotations"]
    assert monitor["spec"]["selector"]["matchLabels"] == {L.NAME: "mixrl", L.INSTANCE: "demo"}
    endpoint_ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    pod_ports = {
        p["name"]
        for _, t in pod_templates(monitored)
        for c in t["spec"]["containers"]
        for p in c.get("ports", [])
    }
    assert endpoint_ports <= pod_ports
    targets = {r["targetLabel"] for r in monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]}
    assert targets == {"run", "pool", "gpu_type", "precision"}


# ----------------------------------------------------------------------------- hashes and replicas


def test_hash_is_stable_ignores_itself_and_follows_the_spec() -> None:
    first = everything(resolved_of(small_run()))
    again = everything(resolved_of(small_run()))
    assert [o["metadata"]["annotations"][HASH_ANNOTATION] for o in first] == [
        o["metadata"]["annotations"][HASH_ANNOTATION] for o in again
    ]
    for obj in first:
        assert obj["metadata"]["annotations"][HASH_ANNOTATION] == desired_hash(obj)
    changed = small_run()
    changed["spec"]["samplerPools"][1]["weightPrecision"] = "bf16"
    after = {(o["kind"], o["metadata"]["name"]): o for o in everything(resolved_of(changed))}
    before = {(o["kind"], o["metadata"]["name"]): o for o in first}
    moved = {key for key in before if desired_hash(before[key]) != desired_hash(after[key])}
    # The changed pool's objects (its labels carry the precision), the shared config and the router
    # (it reads the pool list); not the trainer, buffer, rollout workers or the other pool.
    assert moved == {
        ("ConfigMap", "demo-config"),
        ("SamplerPool", "demo-h100"),
        ("Deployment", "demo-h100"),
        ("Service", "demo-h100"),
        ("Deployment", "demo-router"),
    }


def test_pool_config_hash_wakes_the_pool_controller_when_its_inputs_change() -> None:
    def pool_hash(manifest: Obj) -> str:
        resolved = resolved_of(manifest)
        pools = [
            o
            for o in run_objects(resolved, run_owner(resolved), BuildOptions())
            if o["kind"] == "SamplerPool"
        ]
        return pools[0]["metadata"]["labels"][POOL_CONFIG_HASH_LABEL]

    base = pool_hash(small_run())
    args = small_run()
    args["spec"]["samplerPools"][0]["engineArgs"] = ["--mem-fraction-static", "0.8"]
    other_pool = small_run()
    other_pool["spec"]["samplerPools"][1]["maxReplicas"] = 9
    assert pool_hash(args) != base
    assert pool_hash(other_pool) == base


def test_the_pool_wakes_for_its_scaled_object_but_its_pods_do_not_restart() -> None:
    """The label covers the autoscaling engine (and KEDA's settings in KEDA mode); the pods'
    config-hash does not, so switching who scales a pool restarts no engine."""

    def pool_and_pods(autoscaling: Obj) -> tuple[str, str]:
        manifest = small_run()
        manifest["spec"]["autoscaling"] = autoscaling
        resolved = resolved_of(manifest)
        [sampler] = [
            o
            for o in run_objects(resolved, run_owner(resolved), BuildOptions())
            if o["kind"] == "SamplerPool" and o["spec"]["pool"] == "b200"
        ]
        _, deployment = pool_children(
            resolved, resolved.pool("b200"), 1, pool_owner("demo-b200"), BuildOptions()
        )
        pods = deployment["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
        return sampler["metadata"]["labels"][POOL_CONFIG_HASH_LABEL], pods

    builtin, pods = pool_and_pods({"engine": "builtin", "targetPerReplica": 8})
    assert pool_and_pods({"engine": "builtin", "targetPerReplica": 12}) == (builtin, pods)
    keda, keda_pods = pool_and_pods({"engine": "keda", "targetPerReplica": 8})
    retuned, _ = pool_and_pods({"engine": "keda", "targetPerReplica": 12})
    none, none_pods = pool_and_pods({"engine": "none"})
    assert len({builtin, keda, retuned, none}) == 4
    assert pods == keda_pods == none_pods


def test_the_scaled_object_belongs_to_its_sampler_pool() -> None:
    manifest = small_run()
    manifest["spec"]["autoscaling"] = {"engine": "keda", "targetPerReplica": 8, "fallbackReplicas": 1}
    resolved = resolved_of(manifest)
    pool = resolved.pool("h100")
    owner = pool_owner(pool.object_name)
    scaled = pool_scaled_object(resolved, pool, owner)
    assert scaled["metadata"]["ownerReferences"] == [owner.reference()]
    assert scaled["metadata"]["labels"] == L.pool_labels(resolved, pool)
    assert scaled["metadata"]["annotations"][HASH_ANNOTATION] == desired_hash(scaled)
    assert scaled["spec"]["scaleTargetRef"]["name"] == "demo-h100"
    assert scaled["spec"]["fallback"]["replicas"] == 1


@pytest.mark.parametrize(
    ("minimum", "maximum", "seed"),
    [(0, 4, 1), (2, 8, 2), (0, 0, 0), (3, 3, 3)],
)
def test_seed_replicas_is_min_at_least_one_within_max(minimum: int, maximum: int, seed: int) -> None:
    resolved = resolved_of(
        small_run(pools=[{"name": "p", "gpuType": "H100", "minReplicas": minimum, "maxReplicas": maximum}])
    )
    assert seed_replicas(resolved.pools[0]) == seed
    assert clamp_replicas(100, resolved.pools[0]) == maximum
    assert clamp_replicas(-1, resolved.pools[0]) == minimum


# ----------------------------------------------------------------------------- drain hook (pure part)


def test_drain_counts_queued_and_running_requests_in_both_spellings() -> None:
    text = "\n".join(
        [
            "# HELP sglang:num_running_reqs running",
            'sglang:num_running_reqs{model_name="m",engine_type="unified"} 3.0',
            'sglang_num_queue_reqs{model_name="m"} 2',
            "sglang:num_used_tokens 50",
            "sglang:num_queue_reqs_total 9",
        ]
    )
    assert drain_module.in_flight(text) == 5.0
    assert drain_module.in_flight("") == 0.0
