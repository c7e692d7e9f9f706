"""The real node's pure parts: the bed's images, its network plan and the node's configuration."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from mixrl.devcluster import images, network, node
from mixrl.devcluster.cluster import component_commands


def _members(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {m.name: (tar.extractfile(m).read() if m.isfile() else b"") for m in tar.getmembers()}  # type: ignore[union-attr]


def test_oci_archive_is_a_valid_layout_and_deterministic() -> None:
    spec = images.shell_image(b"\x7fELF-not-really-busybox")
    archive = images.oci_archive(spec)
    assert archive == images.oci_archive(spec), "same inputs, same bytes (and so the same digests)"
    files = _members(archive)
    index = json.loads(files["index.json"])
    (descriptor,) = index["manifests"]
    assert descriptor["annotations"]["io.containerd.image.name"] == images.SHELL_IMAGE
    manifest = json.loads(files["blobs/sha256/" + descriptor["digest"].removeprefix("sha256:")])
    config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"].removeprefix("sha256:")])
    (layer,) = manifest["layers"]
    layer_bytes = files["blobs/sha256/" + layer["digest"].removeprefix("sha256:")]
    assert layer["size"] == len(layer_bytes)
    assert config["rootfs"]["diff_ids"] == [layer["digest"]]  # uncompressed: the digest is the diff id
    rootfs = _members(layer_bytes)
    assert rootfs["bin/busybox"] == b"\x7fELF-not-really-busybox"
    with tarfile.open(fileobj=io.BytesIO(layer_bytes)) as tar:
        assert tar.getmember("bin/sh").linkname == "busybox"
        assert {m.mtime for m in tar.getmembers()} == {0}


def test_a_changed_input_changes_the_digest() -> None:
    one = images.oci_archive(images.pause_image(b"a"))
    two = images.oci_archive(images.pause_image(b"b"))
    assert json.loads(_members(one)["index.json"]) != json.loads(_members(two)["index.json"])


def test_pause_image_stops_on_term() -> None:
    spec = images.pause_image(b"x")
    assert spec.reference == images.PAUSE_IMAGE and spec.user == "65535"
    assert "trap" in spec.entrypoint[-1] and "TERM" in spec.entrypoint[-1]


def test_network_plan_stays_on_the_beds_interfaces() -> None:
    nodes = network.node_addresses(2)
    commands = network.up_commands(nodes)
    created = [c[3] for c in commands if c[:3] == ["ip", "link", "add"]]
    assert created == [network.BRIDGE, "mixrl-n0h", "mixrl-n1h"]
    assert all(len(name) <= 15 for name in created)  # Linux's interface name limit
    host_routes = [c for c in commands if c[:3] == ["ip", "route", "add"]]
    assert [r[3] for r in host_routes] == ["10.245.0.0/24", "10.245.1.0/24"]
    assert all(r[-1] == network.BRIDGE for r in host_routes)
    # Host-wide settings: only forwarding, and only with two nodes or more (then confined by nft).
    host_sysctls = [c for c in commands if "sysctl" in c and c[0] != "nsenter"]
    assert host_sysctls == []
    assert ["nft", "-f", "-"] in commands and ["nft", "-f", "-"] in network.up_commands(nodes[:1])
    assert ["nft", "-f", "-"] not in network.up_commands([])
    subnets = "{ 10.250.0.0/24, 10.245.0.0/16 }"
    on_a_router = network.nft_confinement(host_forwarded=True)
    drops = [line.strip() for line in on_a_router.splitlines() if line.strip().endswith("drop")]
    assert drops == [
        f'iifname "mixrl-*" ip daddr != {subnets} drop',
        f'oifname "mixrl-*" ip saddr != {subnets} drop',
        'iifname "mixrl-*" meta nfproto ipv6 drop',
        'oifname "mixrl-*" meta nfproto ipv6 drop',
    ], "a host that forwarded before keeps forwarding its own traffic"
    assert all(name.startswith(network.INTERFACE_PREFIX) for name in created)
    alone = network.nft_confinement(host_forwarded=False)
    drops = [line.strip() for line in alone.splitlines() if line.strip().endswith("drop")]
    assert drops[4:] == [
        f"ip saddr != {subnets} drop",
        f"ip daddr != {subnets} drop",
        "meta nfproto ipv6 drop",
    ]


def test_node_commands_run_inside_the_node_namespace(tmp_path: Path) -> None:
    (address,) = network.node_addresses(1)
    commands = node.node_commands(Path("/k8s"), tmp_path, address)
    assert list(commands) == ["containerd-0", "kubelet-0", "kube-proxy-0", "netpol-0"]
    for command in commands.values():
        assert command[:3] == ["nsenter", "--net=/run/netns/mixrl-node-0", "--"]
    kubelet = " ".join(commands["kubelet-0"])
    assert "--node-ip=10.250.0.10" in kubelet and f"--node-labels={node.REAL_NODE_LABEL}=true" in kubelet


def test_kubelet_and_proxy_configuration(tmp_path: Path) -> None:
    (address,) = network.node_addresses(1)
    kubelet = node.kubelet_config(tmp_path, address)
    assert kubelet["authentication"]["anonymous"]["enabled"] is False
    assert kubelet["authorization"]["mode"] == "Webhook"
    assert kubelet["clusterDNS"] == [network.HOST_IP] and kubelet["resolvConf"] == ""
    assert kubelet["cgroupRoot"] == "/mixrl-node-0" and kubelet["readOnlyPort"] == 0
    proxy = node.kube_proxy_config(tmp_path, address)
    assert proxy["mode"] == "nftables" and proxy["hostnameOverride"] == "mixrl-node-0"
    cni = node.cni_config(tmp_path, address)
    assert cni["plugins"][0]["ipam"]["ranges"] == [[{"subnet": "10.245.0.0/24"}]]
    assert str(tmp_path) in cni["plugins"][0]["ipam"]["dataDir"]
    containerd = node.containerd_config(tmp_path, address, images.PAUSE_IMAGE)
    assert f'sandbox_image = "{images.PAUSE_IMAGE}"' in containerd
    assert "restrict_oom_score_adj = true" in containerd
    assert str(tmp_path) in containerd.split("[grpc]")[1].split("\n")[1]
    # Images survive `down` in the cache; the bed keeps only state and sockets.
    assert f'root = "{node.containerd_root(address)}"' in containerd and str(tmp_path) not in str(
        node.containerd_root(address)
    )


def test_corefile_serves_only_the_cluster_domain(tmp_path: Path) -> None:
    text = node.corefile(tmp_path / "kubeconfig")
    assert f"bind {network.HOST_IP}" in text and "kubernetes cluster.local" in text
    assert "forward" not in text  # no upstream: nothing resolves off the machine


def test_api_server_listens_on_the_bridge_only_with_real_nodes(tmp_path: Path) -> None:
    ports = dict.fromkeys(("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok"), 1)
    kwok_only = " ".join(component_commands(Path("/bin"), tmp_path, ports)["kube-apiserver"])
    real = " ".join(component_commands(Path("/bin"), tmp_path, ports, network.HOST_IP)["kube-apiserver"])
    assert "--bind-address=127.0.0.1" in kwok_only and "--kubelet-client-certificate" not in kwok_only
    assert f"--bind-address={network.HOST_IP}" in real and "--endpoint-reconciler-type=lease" in real
    assert "--kubelet-client-certificate=" in real and "--kubelet-certificate-authority=" in real
    assert "NodeRestriction" in real


def test_real_nodes_count_is_checked() -> None:
    with pytest.raises(ValueError, match="--real-nodes"):
        network.node_addresses(-1)
