"""The test bed's pure parts: fleet parsing, GFD labels from the GPU table, command lines, stages."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_RESOURCE, GPU_TABLE
from mixrl.api.scheduling import packing_profile
from mixrl.devcluster import kwok_fleet as fleet
from mixrl.devcluster.cli import main
from mixrl.devcluster.cluster import component_commands, scheduler_config, storage_objects
from mixrl.devcluster.stages import stages


def test_default_fleet_covers_every_gpu_of_the_mixed_example() -> None:
    example = yaml.safe_load((Path(__file__).parents[2] / "examples" / "rlrun-mixed.yaml").read_text())
    groups = {g.gpu_type: g for g in fleet.parse_fleet(fleet.DEFAULT_FLEET)}
    for pool in example["spec"]["samplerPools"]:
        assert pool["gpuType"] in groups
    trainer = example["spec"]["trainer"]
    h200 = groups[trainer["gpuType"]]
    assert h200.nodes * h200.gpus_per_node >= trainer["nodes"] * trainer["gpusPerNode"] + 1
    assert groups["cpu"].nodes >= 1


def test_parse_fleet_sizes_and_errors() -> None:
    groups = fleet.parse_fleet("A100=2x4, cpu=1")
    assert [(g.gpu_type, g.nodes, g.gpus_per_node) for g in groups] == [("A100", 2, 4), ("cpu", 1, 0)]
    with pytest.raises(ValueError, match="unknown GPU type 'V100'"):
        fleet.parse_fleet("V100=2")
    with pytest.raises(ValueError, match="'H100:2' is not"):
        fleet.parse_fleet("H100:2")
    with pytest.raises(ValueError, match="at least one GPU"):
        fleet.parse_fleet("H100=1x0")


@pytest.mark.parametrize("gpu_type", [g for g in GPU_TABLE if g != "cpu"])
def test_gpu_nodes_carry_gfd_labels_from_the_gpu_table(gpu_type: str) -> None:
    node = fleet.node(fleet.NodeGroup(gpu_type, 1, 4), 0)
    labels = node["metadata"]["labels"]
    assert labels[GPU_PRODUCT_LABEL] in GPU_TABLE[gpu_type].gfd_products
    assert labels["nvidia.com/gpu.count"] == "4" == node["status"]["allocatable"][GPU_RESOURCE]
    assert labels["nvidia.com/gpu.memory"] == str(GPU_TABLE[gpu_type].memory_gib * 1024)
    assert node["spec"]["taints"] == [fleet.GPU_TAINT]
    assert node["metadata"]["annotations"][fleet.KWOK_ANNOTATION] == fleet.KWOK_ANNOTATION_VALUE


def test_cpu_nodes_have_no_gpu_and_no_taint() -> None:
    node = fleet.node(fleet.NodeGroup("cpu", 1, 0), 0)
    assert GPU_RESOURCE not in node["status"]["allocatable"]
    assert "taints" not in node["spec"] and GPU_PRODUCT_LABEL not in node["metadata"]["labels"]


def test_component_commands_enforce_rbac_admission_and_audit(tmp_path: Path) -> None:
    ports = dict.fromkeys(("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok"), 1)
    commands = component_commands(Path("/bin"), tmp_path, ports)
    api = " ".join(commands["kube-apiserver"])
    assert "--authorization-mode=Node,RBAC" in api
    assert "PodSecurity" in api and "ResourceQuota" in api
    assert "--service-account-signing-key-file=" in api and "--audit-log-path=" in api
    assert "--node-monitor-grace-period=8760h" in commands["kube-controller-manager"]
    # kube-scheduler reads its client and profiles from its --config file (the flags would be ignored).
    scheduler = commands["kube-scheduler"]
    assert f"--config={tmp_path / 'kube-scheduler.yaml'}" in scheduler
    assert not [
        flag for flag in scheduler if flag.startswith(("--kubeconfig", "--kube-api-", "--leader-elect"))
    ]
    kwok = " ".join(commands["kwok"])
    assert (
        f"--manage-nodes-with-annotation-selector={fleet.KWOK_ANNOTATION}={fleet.KWOK_ANNOTATION_VALUE}"
        in kwok
    )


def test_the_scheduler_serves_the_default_profile_and_the_packing_one(tmp_path: Path) -> None:
    config = scheduler_config(tmp_path)
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["clientConnection"] == {
        "kubeconfig": str(tmp_path / "kubeconfig"),
        "qps": 200,
        "burst": 400,
    }
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["profiles"] == [{"schedulerName": "default-scheduler"}, packing_profile()]
    assert packing_profile()["schedulerName"] == "mixrl-packing"


def test_stages_and_storage_are_well_formed() -> None:
    names = [s["metadata"]["name"] for s in stages()]
    assert names == ["node-ready", "pod-running", "pod-delete"]
    objects = storage_objects(3)
    assert [o["kind"] for o in objects] == [
        "StorageClass",
        "PersistentVolume",
        "PersistentVolume",
        "PersistentVolume",
    ]
    assert all(o["spec"]["storageClassName"] == objects[0]["metadata"]["name"] for o in objects[1:])


def test_cli_rejects_a_bad_fleet_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dir", str(tmp_path), "up", "--fleet", "H100=x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mixrl dev-cluster: --fleet: 'H100=x' is not <gpuType>=<nodes>[x<gpusPerNode>]"]


def test_status_of_a_cluster_that_is_not_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dir", str(tmp_path), "status"]) == 1
    assert "not running" in capsys.readouterr().out
