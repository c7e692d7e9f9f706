"""Real CPU nodes of the test bed: containerd, runc, the CNI bridge, a kubelet, kube-proxy and the
bed's NetworkPolicy enforcer (:mod:`mixrl.devcluster.netpol`).

Each node runs in its own network namespace (``mixrl.devcluster.network``) with its processes'
files, sockets and cgroups under the bed's directory and a cgroup root of its own
(``/mixrl-node-<i>`` in every hierarchy), so two nodes never share state and ``down`` knows what to
remove. What a real cluster has and this keeps: node TLS (a serving certificate for the node's IP,
client certificates ``system:node:<name>`` and ``system:kube-proxy``), Node authorization and the
NodeRestriction admission plugin, the API server's own client certificate for ``logs``/``exec``,
Service routing by kube-proxy (nftables mode) and Service DNS by CoreDNS (one for the bed, on the
bridge's address). The node is a CPU node: GPUs exist only on the KWOK nodes.

Everything here is a pure function of the node's address and the bed's directory, except
``stop_node``'s clean-up, which reads ``/proc``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from mixrl.devcluster.network import HOST_IP, POD_SUPERNET, NodeAddress

CNI_BIN = Path("/usr/lib/cni")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTAINERD_RUN = Path("/run/containerd")
CLUSTER_DOMAIN = "cluster.local"
REAL_NODE_LABEL = "mixrl.dev/real-node"
HOST_TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "nsenter", "nft", "ip")
"""Debian's containerd, runc, util-linux, nftables and iproute2 (scripts/setup.sh installs them)."""


def node_dir(bed: Path, node: NodeAddress) -> Path:
    return bed / "nodes" / node.name


def containerd_socket(bed: Path, node: NodeAddress) -> Path:
    return node_dir(bed, node) / "containerd" / "containerd.sock"


def containerd_root(node: NodeAddress) -> Path:
    """Outside the bed's directory, in the cache: the node's images (several GB once the project's
    are in) survive ``down``, so the next bed imports only what changed. ``down`` removes every
    container first, so only images are kept."""
    cache = Path(os.environ.get("MIXRL_CACHE", Path.home() / ".cache" / "mixrl"))
    return cache / "real-node" / node.name / "containerd"


def containerd_config(bed: Path, node: NodeAddress, sandbox_image: str) -> str:
    base = node_dir(bed, node) / "containerd"
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{containerd_root(node)}"
state = "{base / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{containerd_socket(bed, node)}"

[ttrpc]
  address = "{base / "containerd.sock.ttrpc"}"

[debug]
  level = "warn"

[plugins."io.containerd.internal.v1.opt"]
  path = "{base / "opt"}"

[{cri}]
  sandbox_image = "{sandbox_image}"
  # runc's nsexec would lower a container's oom_score_adj, which needs CAP_SYS_RESOURCE: this
  # machine's root lacks it, so the scores are only raised.
  restrict_oom_score_adj = true
  enable_selinux = false
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{node_dir(bed, node) / "cni"}"
"""


def cni_config(bed: Path, node: NodeAddress) -> dict:
    """The CNI bridge inside the node's namespace; host-local addresses from the node's pod subnet."""
    return {
        "cniVersion": "0.4.0",
        "name": "mixrl",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,  # the host routes the pod subnet back: no address translation needed
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node.pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(node_dir(bed, node) / "cni-ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def cgroup_root(node: NodeAddress) -> str:
    return f"/{node.name}"


EVICTION_HARD = {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                 "nodefs.inodesFree": "1%"}  # fmt: skip


def kubelet_config(bed: Path, node: NodeAddress) -> dict:
    pki = node_dir(bed, node) / "pki"
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node.ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",  # the node namespace's own loopback
        "healthzPort": 10248,
        "tlsCertFile": str(pki / "kubelet.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet.key"),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(bed / "pki" / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{containerd_socket(bed, node)}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root(node),
        "failCgroupV1": False,  # this machine has cgroup v1 controllers (a deprecation warning only)
        "failSwapOn": False,
        "clusterDNS": [HOST_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": "",  # no upstream resolver: the bed reaches nothing off the machine
        "podLogsDir": str(node_dir(bed, node) / "pod-logs"),
        "podCIDR": node.pod_cidr,
        "maxPods": 110,
        "serializeImagePulls": False,
        # A shared development disk: evict only when it is really full, never collect the bed's
        # imported images (there is no registry to pull them again from).
        "evictionHard": EVICTION_HARD,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "oomScoreAdj": 0,  # lowering it needs CAP_SYS_RESOURCE
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "shutdownGracePeriod": "0s",
    }


def kube_proxy_config(bed: Path, node: NodeAddress) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(node_dir(bed, node) / "kube-proxy.kubeconfig")},
        "hostnameOverride": node.name,
        "mode": "nftables",
        "clusterCIDR": str(POD_SUPERNET),
        # Pods on one bridge reach each other's Services with replies through the node, without
        # relying on how the kernel treats bridged traffic.
        "nftables": {"masqueradeAll": True},
        "conntrack": {"maxPerCore": 0},  # leave the kernel's table size alone (not ours to set)
        "oomScoreAdj": 0,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
    }


def corefile(kubeconfig: Path) -> str:
    """Service and pod names of the cluster domain, answered from the API server; nothing else
    (no upstream: the bed reaches nothing off the machine)."""
    return f""".:53 {{
    bind {HOST_IP}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} mixrl-dev
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
"""


def cert_kubeconfig(server: str, ca: Path, cert: Path, key: Path, user: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "mixrl-dev", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "mixrl-dev", "context": {"cluster": "mixrl-dev", "user": user}}],
        "current-context": "mixrl-dev",
    }


def node_commands(bin_dir: Path, bed: Path, node: NodeAddress) -> dict[str, list[str]]:
    """containerd, kubelet, kube-proxy and the NetworkPolicy enforcer of one node, each inside the
    node's network namespace, in the order they start."""
    base = node_dir(bed, node)
    inside = node.enter()
    return {
        f"containerd-{node.index}": [*inside, "containerd", f"--config={base / 'containerd.toml'}"],
        f"kubelet-{node.index}": [
            *inside,
            str(bin_dir / "kubelet"),
            f"--config={base / 'kubelet.yaml'}",
            f"--kubeconfig={base / 'kubelet.kubeconfig'}",
            f"--root-dir={base / 'kubelet'}",
            f"--cert-dir={base / 'pki'}",
            f"--hostname-override={node.name}",
            f"--node-ip={node.ip}",
            f"--node-labels={REAL_NODE_LABEL}=true",
            "--v=0",
        ],
        f"kube-proxy-{node.index}": [
            *inside,
            str(bin_dir / "kube-proxy"),
            f"--config={base / 'kube-proxy.yaml'}",
        ],
        # the NetworkPolicy enforcer (mixrl.devcluster.netpol), with the bed's admin kubeconfig
        f"netpol-{node.index}": [
            *inside,
            sys.executable,
            "-m",
            "mixrl.devcluster.netpol",
            str(bed / "kubeconfig"),
            node.name,
        ],
    }


def write_node_files(bed: Path, node: NodeAddress, server: str, sandbox_image: str) -> None:
    """Every file the node's processes read (certificates come from ``cluster.make_node_pki``)."""
    base = node_dir(bed, node)
    for sub in ("containerd", "cni", "cni-ipam", "kubelet", "pod-logs", "pki"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "containerd.toml").write_text(containerd_config(bed, node, sandbox_image))
    (base / "cni" / "10-mixrl.conflist").write_text(json.dumps(cni_config(bed, node), indent=2))
    (base / "kubelet.yaml").write_text(yaml.safe_dump(kubelet_config(bed, node)))
    (base / "kube-proxy.yaml").write_text(yaml.safe_dump(kube_proxy_config(bed, node)))
    ca, pki = bed / "pki" / "ca.crt", base / "pki"
    for name, user in (("kubelet", f"system:node:{node.name}"), ("kube-proxy", "system:kube-proxy")):
        config = cert_kubeconfig(server, ca, pki / f"{name}-client.crt", pki / f"{name}-client.key", user)
        (base / f"{name}.kubeconfig").write_text(yaml.safe_dump(config))


def make_cgroups(node: NodeAddress) -> None:
    """The node's cgroup root in every v1 hierarchy (the kubelet wants it to exist); cpuset needs
    its CPUs and memory nodes copied from the parent, which v1 does not do by itself."""
    for hierarchy in _hierarchies():
        path = hierarchy / node.name
        path.mkdir(exist_ok=True)
        if hierarchy.name == "cpuset":
            for knob in ("cpuset.cpus", "cpuset.mems"):
                (path / knob).write_text((hierarchy / knob).read_text())


def _hierarchies() -> list[Path]:
    if not CGROUP_ROOT.exists():
        return []
    return [p for p in sorted(CGROUP_ROOT.iterdir()) if p.is_dir() and not p.is_symlink()]


def _ctr(socket: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ctr", f"--address={socket}", "-n", "k8s.io", *args], capture_output=True, text=True
    )


def containerd_answers(socket: Path) -> bool:
    """The node's containerd serves its API (its socket appears a moment before it does)."""
    return socket.exists() and _ctr(socket, "version").returncode == 0


def image_references(socket: Path) -> set[str]:
    listed = _ctr(socket, "images", "ls", "-q")
    if listed.returncode != 0:  # an empty answer would import every image again (gigabytes)
        raise RuntimeError(f"ctr images ls failed: {listed.stderr.strip()}")
    return set(listed.stdout.split())


def remove_image(socket: Path, reference: str) -> None:
    _ctr(socket, "images", "rm", reference)


def drain_containerd(socket: Path) -> None:
    """Kill and remove every container of the running containerd (after the kubelet stopped), so
    its cached root keeps images only and the next node starts with no stale pods."""
    for container in _ctr(socket, "containers", "ls", "-q").stdout.split():
        _ctr(socket, "tasks", "kill", "-s", "SIGKILL", container)
        _ctr(socket, "tasks", "delete", "-f", container)
        _ctr(socket, "containers", "rm", container)


def clean_node(bed: Path, node: NodeAddress) -> None:
    """After the node's processes stopped: end what they left running (container shims and the
    containers in the node's cgroups), unmount what they mounted under the bed's directory, and
    remove the node's cgroups."""
    socket = str(containerd_socket(bed, node))
    for pid, cmdline in _processes():
        if socket in cmdline and "containerd-shim" in cmdline:
            _kill(pid)
    for _ in range(50):
        left = _pids_in_cgroups(node)
        if not left:
            break
        for pid in left:
            _kill(pid)
        time.sleep(0.1)
    unmount_under(node_dir(bed, node))
    # containerd's shims and runc keep their sockets, fifos and state in fixed directories under
    # /run/containerd; the bed removes them once empty (another containerd's would not be).
    for leftover in ("fifo", "s", "runc/k8s.io", "runc", ""):
        with contextlib.suppress(OSError):
            (CONTAINERD_RUN / leftover).rmdir()
    for hierarchy in _hierarchies():
        root = hierarchy / node.name
        if root.exists():
            for path in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    path.rmdir()
            with contextlib.suppress(OSError):
                root.rmdir()


def unmount_under(directory: Path) -> None:
    prefix = str(directory.resolve())
    mounts = [m for m in _mount_points() if m == prefix or m.startswith(prefix + "/")]
    for mount in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True)


def _mount_points() -> list[str]:
    points = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            points.append(line.split()[4].replace("\\040", " "))
    return points


def _processes() -> list[tuple[int, str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                found.append(
                    (int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
                )
    return found


def _pids_in_cgroups(node: NodeAddress) -> list[int]:
    pids: set[int] = set()
    for hierarchy in _hierarchies():
        root = hierarchy / node.name
        if root.exists():
            for procs in root.rglob("cgroup.procs"):
                with contextlib.suppress(OSError, ValueError):
                    pids |= {int(p) for p in procs.read_text().split()}
    return sorted(pids - {os.getpid()})


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
