"""The pure builders: every object they produce, checked against Kubernetes' own schemas and the
conventions of docs/architecture.md#objects-and-labels (labels, owners, security, GPU scheduling)."""

from __future__ import annotations

import copy
import json
import re
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
from mixrl.api.resolve import ENGINE_PORT, SGLANG_IMAGE, SGLANG_QUANTIZATION, ResolvedRun, resolve
from mixrl.operator.autoscaling.gpu_check import wrong_gpu_value
from mixrl.operator.builders import labels as L
from mixrl.operator.builders.keda import pool_scaled_object
from mixrl.operator.builders.objects import (
    CONFIG_HASH_ANNOTATION,
    HASH_ANNOTATION,
    POOL_CONFIG_HASH_LABEL,
    BuildOptions,
    Images,
    Monitoring,
    Owner,
    desired_hash,
)
from mixrl.operator.builders.podspec import with_shared
from mixrl.operator.builders.pools import pool_children, pool_objects
from mixrl.operator.builders.resources import clamp_replicas, run_objects, seed_replicas
from mixrl.rl.buffer import cli as buffer_cli
from mixrl.rl.engine import drain as drain_module
from mixrl.rl.engine import server as engine_server
from mixrl.rl.engine import weight_sync
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
    products = list(GPU_TABLE[gpu_type].gfd_products)
    shared = [f"{p}-SHARED" for p in products]  # GFD's names for time-sliced GPUs of the same product
    assert terms == [
        {"matchExpressions": [{"key": GPU_PRODUCT_LABEL, "operator": "In", "values": products + shared}]}
    ]
    assert GPU_TABLE[gpu_type].gfd_products, "every real GPU type has at least one product name"
    engine = spec["containers"][0]
    assert engine["resources"]["limits"][GPU_RESOURCE] == "4"
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
        assert seen[pool.name] == tuple(with_shared(GPU_TABLE[pool.gpu_type].gfd_products))


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
        "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb",
        "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb-SHARED",
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
    # No GPU, but a memory-backed /dev/shm for the torch engine's staging copy of the weights.
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
    engine = next(c for c in spec["containers"] if c["name"] == "engine")
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]


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
    # Strictly above top-k: SGLang aborts a request whose support exceeds the limit.
    assert command[command.index("--sampling-mask-max-tokens") + 1] == "128"
    assert resolved.pools[0].image is None and engine["image"] == Images().sglang == SGLANG_IMAGE
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
    assert flags == [
        "--config",
        "--buffer",
        "--run-dir",
        "--metrics-port",
        "--auth-token-file",
        "--hold-when-done",
    ]
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
    # A stopped trainer saves a checkpoint of its last step: torchrun waits for its ranks (its own
    # default is 30 s) within the pod's grace.
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert trainer["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120  # the default
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "110"
    products = trainer["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    values = products["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"
    ]
    assert values[0]["values"] == with_shared(GPU_TABLE["H200"].gfd_products)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert "/weights" in mounts and not mounts["/weights"].get("readOnly")
    # Every rank writes its checkpoint shards into one directory: the two pods share it on the
    # ReadWriteMany weights volume, instead of a claim each.
    run_dir = mounts["/var/lib/mixrl/trainer"]
    assert (run_dir["name"], run_dir["subPath"]) == (mounts["/weights"]["name"], "trainer-run")
    assert "volumeClaimTemplates" not in trainer["spec"]


def test_the_trainer_pods_stop_grace_is_the_specs() -> None:
    manifest = small_run()
    manifest["spec"]["trainer"]["stopGraceSeconds"] = 900  # a large model's checkpoint
    objects = run_objects(resolved_of(manifest), run_owner(resolved_of(manifest)), BuildOptions())
    (trainer,) = [
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "demo-trainer"
    ]
    pod = trainer["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert (pod["terminationGracePeriodSeconds"], env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) == (900, "890")


def test_a_single_cpu_trainer_runs_without_torchrun() -> None:
    resolved = resolved_of(cpu_run())
    trainer = next(
        o for o in run_objects(resolved, run_owner(resolved), BuildOptions()) if o["kind"] == "StatefulSet"
    )
    command = trainer["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["mixrl", "trainer", "--config", "/etc/mixrl/run.json"]
    (claim,) = trainer["spec"]["volumeClaimTemplates"]  # one pod: its run directory is its own
    assert claim["metadata"]["name"] == "run"
    mounts = {m["mountPath"]: m for m in trainer["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/var/lib/mixrl/trainer"] == {"name": "run", "mountPath": "/var/lib/mixrl/trainer"}


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
    # The trainer's per-pool series keep their own gpu_type and precision (not the trainer pod's).
    assert all(e["honorLabels"] is True for e in monitor["spec"]["podMetricsEndpoints"])


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


# ----------------------------------------------------------------------------- cluster readiness


def containers_of(pod: Obj) -> list[Obj]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def quota_refusal(pod: Obj) -> str | None:
    """What a namespace ResourceQuota on requests.cpu, requests.memory, limits.cpu and limits.memory
    says of a pod (the API server refuses one container without any of them, init containers too)."""
    for c in containers_of(pod):
        res = c.get("resources", {})
        for kind in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                if resource not in res.get(kind, {}):
                    return f"{c['name']}: must specify {kind}.{resource}"
    return None


def test_every_container_passes_a_quota_that_requires_cpu_and_memory_requests_and_limits(
    resolved: ResolvedRun,
) -> None:
    pods = [t["spec"] for _, t in pod_templates(everything(resolved))]
    assert len(pods) == 4 + len(resolved.pools)
    for pod in pods:
        assert quota_refusal(pod) is None
        for c in containers_of(pod):  # Burstable or Guaranteed, never BestEffort; limits >= requests
            res = c["resources"]
            assert parse_quantity(res["limits"]["cpu"]) >= parse_quantity(res["requests"]["cpu"]), c["name"]
            assert parse_quantity(res["limits"]["memory"]) >= parse_quantity(res["requests"]["memory"]), c[
                "name"
            ]
    assert quota_refusal({"containers": [{"name": "x", "resources": {"requests": {"cpu": "1"}}}]}) is not None


def parse_quantity(text: str) -> float:
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text.removesuffix(suffix)) * factor
    return float(text)


def test_the_spec_trainer_resources_are_requests_and_limits() -> None:
    manifest = small_run()
    manifest["spec"]["trainer"]["resources"] = {"cpu": "48", "memory": "900Gi"}
    objects = run_objects(resolved_of(manifest), run_owner(resolved_of(manifest)), BuildOptions())
    trainer = next(
        o for o in objects if o["metadata"]["name"] == "demo-trainer" and o["kind"] == "StatefulSet"
    )
    resources = trainer["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources == {
        "requests": {"cpu": "48", "memory": "900Gi"},
        "limits": {"cpu": "48", "memory": "900Gi", GPU_RESOURCE: "8"},
    }


def test_weight_sync_memory_follows_the_model_size() -> None:
    """The init container and sidecar of an SGLang pool hold the BF16 checkpoint and its conversion."""

    def sync_memory(size: float | None, precision: str) -> str:
        manifest = small_run(pools=[{"name": "p", "gpuType": "H200", "weightPrecision": precision}])
        if size is not None:
            manifest["spec"]["model"]["parametersBillions"] = size
        spec, _ = engine_of(resolved_of(manifest))
        init, sidecar = spec["initContainers"][0], spec["containers"][1]
        assert init["resources"] == sidecar["resources"]
        memory: str = sidecar["resources"]["limits"]["memory"]
        return memory

    assert sync_memory(None, "fp8") == "32Gi"  # unknown size: room for a model of about 8B
    assert sync_memory(8, "bf16") == "34Gi"  # 8e9 x (2 + 2) bytes, +10 %, +1 GiB
    assert sync_memory(30, "fp8") == "94Gi"  # 30e9 x (2 + 1) bytes
    cpu_pool = engine_of(resolved_of(cpu_run()))[0]["containers"][1]["resources"]
    # the torch engine's sidecar converts nothing: beside a CPU engine, the least a Python process needs
    assert cpu_pool == {
        "requests": {"cpu": "25m", "memory": "256Mi"},
        "limits": {"cpu": "500m", "memory": "1Gi"},
    }


def test_every_pod_changes_volume_ownership_only_on_root_mismatch(resolved: ResolvedRun) -> None:
    for _, template in pod_templates(everything(resolved)):
        context = template["spec"]["securityContext"]
        assert context["fsGroup"] == 1000 and context["fsGroupChangePolicy"] == "OnRootMismatch"


def test_pull_secrets_reach_every_pod(resolved: ResolvedRun) -> None:
    options = BuildOptions(images=Images(pull_secrets=("regcred", "mirror")))
    templates = pod_templates(everything(resolved, options))
    assert len(templates) == 4 + len(resolved.pools)
    for workload, template in templates:
        assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}], workload[
            "metadata"
        ]["name"]
    for _, template in pod_templates(everything(resolved)):
        assert "imagePullSecrets" not in template["spec"]


PINNED = re.compile(r"^[^\s:@]+(:[0-9]+/[^\s:@]+)?:[A-Za-z0-9_][A-Za-z0-9_.-]*(@sha256:[0-9a-f]{64})?$")


def test_no_pod_runs_an_untagged_or_latest_image(resolved: ResolvedRun) -> None:
    objects = everything(resolved)
    for _, template in pod_templates(objects):
        for c in containers_of(template["spec"]):
            assert PINNED.match(c["image"]) and not c["image"].endswith(":latest"), c["image"]
    assert ":latest" not in json.dumps(objects), "not even in the run's ConfigMap"


def test_images_come_from_the_operator_unless_the_spec_names_one() -> None:
    images = Images(
        components="reg/components:1",
        trainer_torch="reg/trainer-torch:1",
        trainer_megatron="reg/trainer-megatron:1",
        torch_engine="reg/engine:1",
        sglang="reg/sglang:1",
    )
    manifest = small_run(
        pools=[
            {"name": "sg", "gpuType": "H100"},
            {"name": "te", "gpuType": "cpu", "engine": "torch"},
            {"name": "own", "gpuType": "H100", "image": "team/sglang:patched"},
        ]
    )
    resolved = resolved_of(manifest)
    objects = everything(resolved, BuildOptions(images=images))
    image = {
        o["metadata"]["name"]: [c["image"] for c in containers_of(o["spec"]["template"]["spec"])]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    }
    assert image["demo-trainer"] == ["reg/trainer-torch:1"]
    assert image["demo-sg"] == ["reg/components:1", "reg/sglang:1", "reg/components:1"]
    assert image["demo-te"] == ["reg/components:1", "reg/engine:1", "reg/components:1"]
    assert image["demo-own"][1] == "team/sglang:patched"
    assert image["demo-router"] == image["demo-buffer"] == image["demo-rollout"] == ["reg/components:1"]
    assert images.trainer("megatron") == "reg/trainer-megatron:1"  # kept for the backend to come
    manifest["spec"]["trainer"]["image"] = "team/trainer:2"
    objects = run_objects(resolved_of(manifest), run_owner(resolved), BuildOptions(images=images))
    trainer = next(
        o for o in objects if o["metadata"]["name"] == "demo-trainer" and o["kind"] == "StatefulSet"
    )
    assert trainer["spec"]["template"]["spec"]["containers"][0]["image"] == "team/trainer:2"


def weights_claim(manifest: Obj, options: BuildOptions) -> Obj:
    resolved = resolved_of(manifest)
    claim: Obj = next(
        o for o in run_objects(resolved, run_owner(resolved), options) if o["kind"] == "PersistentVolumeClaim"
    )
    return claim


def test_the_weights_volume_names_the_runs_storage_class_else_the_operators() -> None:
    operator_default = BuildOptions(images=Images(weights_storage_class="nfs-rwx"))
    assert weights_claim(small_run(), operator_default)["spec"]["storageClassName"] == "nfs-rwx"
    manifest = small_run()
    manifest["spec"]["weights"]["storageClassName"] = "cephfs"
    claim = weights_claim(manifest, operator_default)
    assert claim["spec"]["storageClassName"] == "cephfs"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], (
        "the trainer writes, engines on other nodes read"
    )
    kubernetes_validate.validate(claim, K8S_VERSIONS[-1], strict=True)
    assert "storageClassName" not in weights_claim(small_run(), BuildOptions())["spec"]  # cluster default


def test_a_bad_storage_class_name_is_one_line_naming_the_field() -> None:
    manifest = small_run()
    manifest["spec"]["weights"]["storageClassName"] = "Fast NFS"
    with pytest.raises(InvalidSpec) as caught:
        parse_document(manifest)
    assert caught.value.first_line.startswith("spec.weights.storageClassName: ")
    assert len(caught.value.problems) == 1


def test_the_trainer_gets_tolerations_node_selection_and_a_priority_class() -> None:
    manifest = small_run()
    manifest["spec"]["trainer"]["scheduling"] = {
        "gpuProducts": ["NVIDIA-H200"],
        "nodeSelector": {"topology.kubernetes.io/zone": "us-east-1a"},
        "tolerations": [{"key": "training", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "rl-trainer",
    }
    resolved = resolved_of(manifest)
    trainer = next(
        o
        for o in run_objects(resolved, run_owner(resolved), BuildOptions())
        if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "demo-trainer"
    )
    spec = trainer["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [
        {
            "matchExpressions": [
                {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": ["NVIDIA-H200", "NVIDIA-H200-SHARED"]}
            ]
        }
    ]
    assert spec["nodeSelector"] == {"topology.kubernetes.io/zone": "us-east-1a"}
    assert spec["tolerations"] == [
        {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
        {"key": "training", "operator": "Exists", "effect": "NoSchedule"},
    ]
    assert spec["priorityClassName"] == "rl-trainer"
    kubernetes_validate.validate(trainer, K8S_VERSIONS[-1], strict=True)
    # Without a scheduling section: the GPU table's products and the GPU taint, nothing else.
    plain = resolved_of(small_run())
    default = next(
        o
        for o in run_objects(plain, run_owner(plain), BuildOptions())
        if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "demo-trainer"
    )["spec"]["template"]["spec"]
    assert default["tolerations"] == [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    assert "priorityClassName" not in default and "nodeSelector" not in default


def test_without_gpu_feature_discovery_the_platforms_node_labels_are_an_alternative() -> None:
    """Node selector terms are OR-ed: a GFD product label of the type, or every label the platform
    named for the type; the pool's own nodeSelector is required on top of either."""
    selectors = {"H100": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "pool": "gpu"}}
    options = BuildOptions(images=Images(gpu_node_selectors=selectors))
    pool = {"name": "p", "gpuType": "H100", "scheduling": {"nodeSelector": {"spot": "false"}}}
    spec, _ = engine_of(resolved_of(small_run(pools=[pool])), options=options)
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [
        {
            "matchExpressions": [
                {
                    "key": GPU_PRODUCT_LABEL,
                    "operator": "In",
                    "values": with_shared(GPU_TABLE["H100"].gfd_products),
                }
            ]
        },
        {
            "matchExpressions": [
                {"key": "cloud.google.com/gke-accelerator", "operator": "In", "values": ["nvidia-h100-80gb"]},
                {"key": "pool", "operator": "In", "values": ["gpu"]},
            ]
        },
    ]
    assert spec["nodeSelector"] == {"spot": "false"}
    # Another GPU type has no alternative: only its products.
    other, _ = engine_of(resolved_of(small_run(pools=[{"name": "p", "gpuType": "H200"}])), options=options)
    assert (
        len(
            other["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                "nodeSelectorTerms"
            ]
        )
        == 1
    )


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels and In expressions) selects a pod with ``labels``."""
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and all(
        labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
    )


def requests_gpus(template: Obj) -> bool:
    return any(
        GPU_RESOURCE in c.get("resources", {}).get("limits", {}) for c in template["spec"]["containers"]
    )


def test_gpu_pods_prefer_nodes_running_gpu_pods_of_their_run_then_of_any_run() -> None:
    """Packing (issue #31): the trainer's and the engines' pods prefer nodes where GPU pods of their
    run already are (weight 100), then of any mixrl run in any namespace (10), so small replicas do
    not open whole nodes a multi-GPU trainer needs; the required GPU node affinity stays beside the
    preference. CPU pods get none, and no pod names a scheduler unless the operator is told one."""
    resolved = resolved_of(small_run())
    templates = pod_templates(everything(resolved))
    gpu = [template for _, template in templates if requests_gpus(template)]
    cpu = [template for _, template in templates if not requests_gpus(template)]
    assert len(gpu) == 3 and cpu  # the trainer, two pools; router, buffer, rollout
    other_run = {**gpu[0]["metadata"]["labels"], L.INSTANCE: "another-run"}
    for template in gpu:
        spec = template["spec"]
        assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        own, any_run = spec["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert (own["weight"], any_run["weight"]) == (100, 10)
        for term in (own, any_run):
            assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert "namespaceSelector" not in own["podAffinityTerm"]  # the run's own namespace
        assert any_run["podAffinityTerm"]["namespaceSelector"] == {}  # every namespace
        own_selector = own["podAffinityTerm"]["labelSelector"]
        any_selector = any_run["podAffinityTerm"]["labelSelector"]
        assert all(selects(own_selector, t["metadata"]["labels"]) for t in gpu)
        assert not any(selects(own_selector, t["metadata"]["labels"]) for t in cpu)
        assert not selects(own_selector, other_run) and selects(any_selector, other_run)
        assert not any(selects(any_selector, t["metadata"]["labels"]) for t in cpu)
        assert "schedulerName" not in spec
    for template in cpu:
        assert "podAffinity" not in template["spec"].get("affinity", {})
    # Turned off, the preference goes and the GPU node affinity stays; a scheduler profile is named
    # by the GPU pods only.
    options = BuildOptions(images=Images(pack_gpu_pods=False, scheduler_name="mixrl-packing"))
    for workload, template in pod_templates(everything(resolved, options)):
        spec = template["spec"]
        if requests_gpus(template):
            assert set(spec["affinity"]) == {"nodeAffinity"}
            assert spec["schedulerName"] == "mixrl-packing"
        else:
            assert "schedulerName" not in spec
        kubernetes_validate.validate(workload, K8S_VERSIONS[-1], strict=True)
    for workload, _ in templates:
        kubernetes_validate.validate(workload, K8S_VERSIONS[-1], strict=True)


def test_a_time_sliced_node_runs_the_gpu_its_product_names() -> None:
    """A GPU reports its own name: an allowed ``-SHARED`` product is not a wrong GPU type."""
    assert wrong_gpu_value({"NVIDIA H100 80GB HBM3"}, ("NVIDIA-H100-80GB-HBM3-SHARED",)) == (
        "False",
        "ProductsMatch",
        "pods run on NVIDIA-H100-80GB-HBM3",
    )
    value = wrong_gpu_value({"NVIDIA A100-SXM4-40GB"}, ("NVIDIA-H100-80GB-HBM3-SHARED",))
    assert value is not None and value[0] == "True"


def test_pod_monitor_labels_let_prometheus_select_it_but_not_replace_the_operators() -> None:
    resolved = resolved_of(small_run())
    labels = {"release": "kube-prometheus-stack", L.INSTANCE: "someone-else"}
    options = BuildOptions(monitoring=Monitoring.POD_MONITOR, images=Images(pod_monitor_labels=labels))
    (monitor,) = [o for o in run_objects(resolved, run_owner(resolved), options) if o["kind"] == "PodMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["metadata"]["labels"][L.INSTANCE] == "demo"


# ----------------------------------------------------------------------------- GPU memory


def memory_refusal(pool: Obj, size: float, trainer: Obj | None = None) -> str | None:
    manifest = small_run(pools=[pool])
    manifest["spec"]["model"]["parametersBillions"] = size
    if trainer is not None:
        manifest["spec"]["trainer"] = trainer
    try:
        parse_document(manifest)
    except InvalidSpec as exc:
        assert len(exc.problems) == 1
        return exc.first_line
    return None


def test_a_bf16_30b_model_at_tp1_is_refused_on_40gb_a100s() -> None:
    a100 = {"name": "a100", "gpuType": "A100", "weightPrecision": "bf16", "gpusPerReplica": 1}
    assert memory_refusal(a100, 30) == (
        "spec.samplerPools[0].gpusPerReplica: a 30B-parameter model in bf16 needs 56 GiB per GPU over "
        "1 GPU, more than 90% of the 40 GiB of NVIDIA-A100-SXM4-40GB; raise gpusPerReplica (tensor "
        "parallelism) or list larger GPUs in scheduling.gpuProducts"
    )
    # Two GPUs per replica, or only the 80 GB parts: it fits.
    assert memory_refusal({**a100, "gpusPerReplica": 2}, 30) is None
    only_80 = {**a100, "scheduling": {"gpuProducts": ["NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"]}}
    assert memory_refusal(only_80, 30) is None
    # Without the model's size nothing is guessed.
    assert parse_document(small_run(pools=[a100]))


@pytest.mark.parametrize(
    ("pool", "size", "refused"),
    [
        ({"gpuType": "H100", "weightPrecision": "fp8"}, 70, False),  # 65 GiB of 80
        ({"gpuType": "H100", "weightPrecision": "bf16"}, 70, True),
        ({"gpuType": "B200", "weightPrecision": "nvfp4"}, 235, False),  # 4.5 bits per weight
        (
            {
                "gpuType": "H100",
                "weightPrecision": "fp8",
                "scheduling": {"gpuProducts": ["NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"]},
            },
            14,
            True,
        ),
        # Emulated precisions on CPU: no GPU memory to check (the trainer's 16 H200s hold 100B).
        ({"gpuType": "cpu", "engine": "torch", "gpusPerReplica": 0}, 100, False),
    ],
)
def test_pool_memory_follows_precision_and_the_products(pool: Obj, size: float, refused: bool) -> None:
    assert (memory_refusal({"name": "p", **pool}, size) is not None) is refused


def test_a_trainer_that_cannot_hold_weights_gradients_and_adam_state_is_refused() -> None:
    pool = {"name": "p", "gpuType": "B200", "weightPrecision": "nvfp4", "gpusPerReplica": 4}
    line = memory_refusal(pool, 235, trainer={"gpuType": "H100", "nodes": 1, "gpusPerNode": 8})
    assert line is not None and line.startswith("spec.trainer.gpusPerNode: training a 235B-parameter model")
    assert memory_refusal(pool, 235, trainer={"gpuType": "H100", "nodes": 4, "gpusPerNode": 8}) is None


def test_every_component_gets_the_runs_token_and_sglang_its_api_key() -> None:
    """docs/auth.md: the run's Secret is mounted in every pod and named on every component's command
    line; SGLang gets it as --api-key through a secretKeyRef, never as a literal."""
    pools = [
        {"name": "b200", "gpuType": "B200", "weightPrecision": "nvfp4"},
        {"name": "emulated", "gpuType": "cpu", "engine": "torch", "gpusPerReplica": 0},
    ]
    resolved = resolved_of(small_run(pools=pools))
    objects = run_objects(resolved, run_owner(resolved), BuildOptions())
    secret = next(o for o in objects if o["kind"] == "Secret")
    assert secret["metadata"]["name"] == "demo-auth" and "data" not in secret and "stringData" not in secret
    pods = [o for o in objects if o["kind"] in ("StatefulSet", "Deployment")]
    for pool in resolved.pools:
        pods += [
            o
            for o in pool_objects(resolved, pool, 1, run_owner(resolved), BuildOptions())
            if o["kind"] == "Deployment"
        ]
    for workload in pods:
        spec = workload["spec"]["template"]["spec"]
        assert {"name": "auth", "secret": {"secretName": "demo-auth", "defaultMode": 0o400}} in spec[
            "volumes"
        ]
        for c in spec["containers"]:
            command = c.get("command", []) + c.get("args", [])
            if "sglang.launch_server" in command:
                assert command[command.index("--api-key") + 1] == "$(MIXRL_AUTH_TOKEN)"
                ref = next(e for e in c["env"] if e["name"] == "MIXRL_AUTH_TOKEN")["valueFrom"][
                    "secretKeyRef"
                ]
                assert ref == {"name": "demo-auth", "key": "token"}
            else:
                assert command[command.index("--auth-token-file") + 1] == "/var/run/mixrl/auth/token", c[
                    "name"
                ]


def test_an_engine_pod_is_ready_only_while_its_sidecar_has_seen_the_engine_labelled() -> None:
    from mixrl.api.launch import LABELLED_FILE
    from mixrl.api.pod_dirs import ENGINE_WEIGHTS_DIR

    resolved = resolve(load_rlrun(ROOT / "examples" / "rlrun-mixed.yaml"))
    pool = resolved.pools[0]
    owner = Owner("mixrl.dev/v1alpha1", "SamplerPool", pool.object_name, "p")
    deployment = next(
        o for o in pool_children(resolved, pool, 1, owner, BuildOptions()) if o["kind"] == "Deployment"
    )
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    probe = containers["weight-sync"]["readinessProbe"]
    assert probe["exec"]["command"] == ["cat", f"{ENGINE_WEIGHTS_DIR}/{LABELLED_FILE}"]
    # The file is in the volume both containers share, where the sidecar writes it.
    mounts = {m["mountPath"] for m in containers["weight-sync"]["volumeMounts"]}
    assert ENGINE_WEIGHTS_DIR in mounts
