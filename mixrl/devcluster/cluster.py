"""A real Kubernetes control plane on loopback, with a simulated GPU fleet (the test bed).

etcd, kube-apiserver (RBAC, service-account token signing, the default admission plugins with Pod
Security and ResourceQuota), kube-controller-manager (garbage collector, ReplicaSets,
StatefulSets, the PV binder, quotas…), kube-scheduler and the KWOK controller run as local
processes in one run directory; KWOK makes the fleet's nodes Ready and scheduled pods Running
without containers. What differs from a real cluster, on purpose:

- no kubelet, so no container runs: pods are Running as soon as they are scheduled;
- simulated nodes send no heartbeats, so the node-lifecycle controller gets a year's grace;
- the admin authenticates with a static token (``--token-auth-file``), which is a test-bed
  shortcut; the operator under test uses a TokenRequest token of its ServiceAccount;
- storage: a no-provisioner StorageClass with pre-created PVs, so claims bind and nothing is written.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from mixrl.api.scheduling import DEFAULT_SCHEDULER, packing_profile, scheduler_configuration
from mixrl.devcluster import images, monitoring
from mixrl.devcluster import node as real_node
from mixrl.devcluster.kwok_fleet import KWOK_ANNOTATION, KWOK_ANNOTATION_VALUE, NodeGroup, fleet_nodes
from mixrl.devcluster.network import HOST_IP, NETNS_DIR, Network, NetworkError, NodeAddress, node_addresses
from mixrl.devcluster.stages import stages_yaml

REPO = Path(__file__).resolve().parents[2]
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
SERVICE_CIDR = "10.96.0.0/16"
STORAGE_CLASS = "mixrl-dev"
NETWORK_OWNER = Path("/run/mixrl-bed-owner.json")
"""Which bed built the real-node network: its directory and one of its processes (the ``up`` at
work, then its API server). The network's names are fixed, so building it takes down another bed's:
``up`` refuses while that bed's process lives. Under /run, so a reboot forgets it."""
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


# The processes this interpreter started, kept so they are reaped (waited for) rather than dropped
# while running, which Python reports as a ResourceWarning.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class ClusterError(RuntimeError):
    """The test bed could not start (or is not running); the message says which part and why."""


def default_dir() -> Path:
    return Path(os.environ.get("MIXRL_CACHE", Path.home() / ".cache" / "mixrl")) / "dev-cluster"


def binaries_dir() -> Path:
    """Where the pinned binaries are: $MIXRL_K8S_BIN, else what scripts/k8s-bin.sh builds (or finds)."""
    if env := os.environ.get("MIXRL_K8S_BIN"):
        return Path(env)
    script = REPO / "scripts" / "k8s-bin.sh"
    if not script.exists():
        raise ClusterError("no MIXRL_K8S_BIN and no scripts/k8s-bin.sh: run from a mixrl checkout")
    done = subprocess.run([str(script)], stdout=subprocess.PIPE, text=True)  # progress goes to stderr
    if done.returncode != 0:
        raise ClusterError("scripts/k8s-bin.sh failed (see its output above)")
    return Path(done.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class ProjectImage:
    """One image of the project's Dockerfiles as ``scripts/images.sh`` built it."""

    component: str
    reference: str
    archive: Path


# Where each image goes in the chart's values (charts/mixrl/values.yaml).
CHART_IMAGE_VALUES = {
    "operator": ("image",),
    "components": ("componentsImage",),
    "trainer-torch": ("trainerImages", "torch"),
    "engine-torch": ("engineImages", "torch"),
}


def project_images() -> list[ProjectImage]:
    """Build (or find cached) the project's images: ``scripts/images.sh`` prints one
    ``<component> <reference> <archive>`` line per image on stdout, its progress on stderr."""
    script = REPO / "scripts" / "images.sh"
    if not script.exists():
        raise ClusterError("no scripts/images.sh: run from a mixrl checkout")
    done = subprocess.run([str(script)], stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise ClusterError("scripts/images.sh failed (see its output above)")
    found = []
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3:
            found.append(ProjectImage(parts[0], parts[1], Path(parts[2])))
    if not found:
        raise ClusterError("scripts/images.sh printed no image")
    return found


def chart_values(built: list[ProjectImage]) -> dict:
    """Helm values that make the chart's operator and every run's pods use the bed's images."""
    values: dict = {}
    for image in built:
        path = CHART_IMAGE_VALUES.get(image.component)
        if path is None:
            continue
        repository, tag = image.reference.rsplit(":", 1)
        target = values
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = {"repository": repository, "tag": tag}
    return values


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: each socket stays bound until all are chosen (one at a time,
    the kernel may hand the same port out twice: etcd's peer port and the scheduler's once met)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


@dataclass
class ClusterState:
    """What ``up`` wrote to ``state.json``: enough for ``status``, ``down`` and the tests."""

    dir: str
    bin: str
    server: str
    token: str
    ports: dict[str, int]
    pids: dict[str, int]
    """Every process of the bed, in the order it started (``down`` stops them in reverse)."""
    real_nodes: int = 0
    address: str = "127.0.0.1"
    """Where the API server listens: loopback, or the bed bridge's address when real nodes run."""
    netns_before: list[str] | None = None
    """The pod network namespaces that existed before the bed's nodes started (``down`` removes
    only the ones its containerd made)."""
    starts: dict[str, int] | None = None
    """Per process, its start time (clock ticks after boot, :func:`process_start`): with
    ``boot_id``, what tells the bed's process from another that got its pid after a reboot or a
    crash. None in a state written before mixrl recorded it: no pid of it can be checked."""
    boot_id: str | None = None
    """The kernel's boot id when the processes started."""
    host_dirs: list[str] = field(default_factory=list)
    """Directories outside ``dir`` the bed made (Kueue's mount point), parents first: ``down``
    removes them once empty."""

    @property
    def kubeconfig(self) -> Path:
        return Path(self.dir) / "kubeconfig"

    @property
    def audit_log(self) -> Path:
        return Path(self.dir) / "logs" / "audit.log"

    @property
    def ca_file(self) -> Path:
        return Path(self.dir) / "pki" / "ca.crt"


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(f"openssl {args[0]} failed: {done.stderr.strip().splitlines()[-1:]}")


PKI_VERSION = "3"
"""Bump when the certificates below change (2: the bed bridge's address in the API server's names;
3: the aggregation layer's front-proxy CA and client)."""


FRONT_PROXY_CLIENT = "front-proxy-client"
"""The aggregation layer's client name (``--requestheader-allowed-names``)."""


def make_pki(pki: Path) -> None:
    """A CA, the API server's serving certificate (loopback, the bed bridge's address and the
    in-cluster names), its client certificate for the kubelets, and the service-account signing
    key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    if (pki / "sa.pub").exists() and _read(pki / "version") == PKI_VERSION:
        return
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj", "/CN=mixrl-dev-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=pki)  # fmt: skip
    san = (
        f"subjectAltName=IP:127.0.0.1,IP:{HOST_IP},IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    )
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver", "-addext", san,
             "-keyout", "apiserver.key", "-out", "apiserver.csr", cwd=pki)  # fmt: skip
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "3650", "-copy_extensions", "copyall", "-out", "apiserver.crt", cwd=pki)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    # `kubectl logs/exec` go from the API server to the kubelet, which checks this client.
    issue_certificate(
        pki, pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client"
    )
    # The aggregation layer: the API server proxies to aggregated API servers (KEDA's external
    # metrics) as this client, and they trust the user it names in headers because this CA (a CA
    # of its own, as kubeadm makes it: the bed CA signs every other client) signed it.
    # P-256 keys: the bed's start stays as fast as before.
    front_proxy = pki / "front-proxy"
    front_proxy.mkdir(exist_ok=True)
    _openssl("req", "-x509", *EC_KEY, "-nodes", "-days", "3650", "-subj", "/CN=mixrl-dev-front-proxy-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=front_proxy)  # fmt: skip
    issue_certificate(front_proxy, pki, "front-proxy-client", f"/CN={FRONT_PROXY_CLIENT}", key=EC_KEY)
    (pki / "version").write_text(PKI_VERSION)


RSA_KEY = ("-newkey", "rsa:2048")
EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")
"""A P-256 key: made in milliseconds where an RSA key takes a second on a busy machine."""


def issue_certificate(
    ca_dir: Path, out: Path, name: str, subject: str, san: str | None = None, key: tuple[str, ...] = RSA_KEY
) -> None:
    """``<name>.crt``/``<name>.key`` in ``out``, signed by the bed's CA."""
    out.mkdir(parents=True, exist_ok=True)
    extra = ["-addext", f"subjectAltName={san}"] if san else []
    _openssl("req", *key, "-nodes", "-subj", subject, *extra,
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=out)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca_dir / "ca.crt"), "-CAkey", str(ca_dir / "ca.key"),
             "-CAcreateserial", "-days", "3650", "-copy_extensions", "copyall", "-out", f"{name}.crt", cwd=out)  # fmt: skip


def make_node_pki(bed: Path, node: NodeAddress) -> None:
    """The node's serving certificate (its IP) and the clients of its kubelet and kube-proxy, as
    Node authorization and the default RBAC expect them."""
    ca, pki = bed / "pki", real_node.node_dir(bed, node) / "pki"
    issue_certificate(ca, pki, "kubelet", f"/CN={node.name}", san=f"IP:{node.ip},DNS:{node.name}")
    issue_certificate(ca, pki, "kubelet-client", f"/O=system:nodes/CN=system:node:{node.name}")
    issue_certificate(ca, pki, "kube-proxy-client", "/CN=system:kube-proxy")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def kubeconfig(server: str, ca_file: Path, token: str, user: str = "admin") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "mixrl-dev", "cluster": {"server": server, "certificate-authority": str(ca_file)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "mixrl-dev", "context": {"cluster": "mixrl-dev", "user": user}}],
        "current-context": "mixrl-dev",
    }


def component_commands(
    bin_dir: Path, run_dir: Path, ports: dict[str, int], address: str = "127.0.0.1"
) -> dict[str, list[str]]:
    """The command line of every control-plane process (pure; ``up`` starts them in this order).
    ``address`` is where the API server listens: loopback for a KWOK-only bed, the bed bridge's
    address when real nodes (and their pods) must reach it."""
    pki, kube = run_dir / "pki", str(run_dir / "kubeconfig")
    etcd = f"http://127.0.0.1:{ports['etcd']}"
    loopback = address == "127.0.0.1"
    # A loopback address cannot back the `kubernetes` Service; the bridge's can, as on a real cluster.
    endpoints = ["--endpoint-reconciler-type=none"] if loopback else ["--endpoint-reconciler-type=lease"]
    kubelet_client = [] if loopback else [
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        f"--kubelet-certificate-authority={pki / 'ca.crt'}",
        "--kubelet-preferred-address-types=InternalIP",
    ]  # fmt: skip
    return {
        "etcd": [
            str(bin_dir / "etcd"),
            f"--data-dir={run_dir / 'etcd'}",
            f"--listen-client-urls={etcd}",
            f"--advertise-client-urls={etcd}",
            f"--listen-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
            f"--initial-cluster=default=http://127.0.0.1:{ports['etcd-peer']}",
            "--unsafe-no-fsync",  # a throw-away test bed: durability is not under test, speed is
            "--log-level=warn",
        ],
        "kube-apiserver": [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers={etcd}",
            f"--bind-address={address}",
            f"--advertise-address={address}",
            *endpoints,
            *kubelet_client,
            f"--secure-port={ports['apiserver']}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={run_dir / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # The aggregation layer (APIServices such as KEDA's external metrics): its front-proxy
            # client and the headers that carry the user. No --enable-aggregator-routing: an
            # aggregated server on the host is reached through an ExternalName Service (Endpoints
            # may not hold loopback addresses), which only the Service-address resolver follows.
            f"--requestheader-client-ca-file={pki / 'front-proxy' / 'ca.crt'}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            # The defaults (NamespaceLifecycle, LimitRanger, ServiceAccount, PodSecurity,
            # ResourceQuota, DefaultStorageClass, the admission webhooks…), named so a reader sees them.
            "--enable-admission-plugins=NamespaceLifecycle,LimitRanger,ServiceAccount,NodeRestriction,PodSecurity,"
            "DefaultStorageClass,DefaultTolerationSeconds,PersistentVolumeClaimResize,Priority,"
            "MutatingAdmissionWebhook,ValidatingAdmissionPolicy,ValidatingAdmissionWebhook,ResourceQuota",
            # Every request not made by the admin (the control plane's own components use the admin
            # token) is audited: tests count the operator's API calls from the server's side.
            f"--audit-policy-file={run_dir / 'audit-policy.yaml'}",
            f"--audit-log-path={run_dir / 'logs' / 'audit.log'}",
            "--audit-log-format=json",
            "--profiling=false",
            "--v=0",
        ],
        "kube-controller-manager": [
            str(bin_dir / "kube-controller-manager"),
            f"--kubeconfig={kube}",
            f"--authentication-kubeconfig={kube}",
            f"--authorization-kubeconfig={kube}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports['controller-manager']}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Simulated nodes send no heartbeats: a year's grace keeps the node-lifecycle controller
            # (which lifts the not-ready taint from Ready nodes) from declaring them lost.
            "--node-monitor-grace-period=8760h",
            "--node-startup-grace-period=8760h",
            # Client rate limits as large clusters set them (the defaults, 20 QPS, would make a
            # 1,000-node bed measure the controller-manager's throttle instead of the operator).
            "--kube-api-qps=200",
            "--kube-api-burst=400",
            # Every controller runs (the default --controllers=*), the HPA among them; it reads its
            # metrics every 2 s instead of 15 s so a test of KEDA's HPA follows load in seconds.
            "--horizontal-pod-autoscaler-sync-period=2s",
            "--leader-elect=false",
            "--v=0",
        ],
        "kube-scheduler": [
            str(bin_dir / "kube-scheduler"),
            # Its client, leader election and profiles: scheduler_config() (with --config, the
            # flags for those are ignored).
            f"--config={run_dir / 'kube-scheduler.yaml'}",
            f"--authentication-kubeconfig={kube}",
            f"--authorization-kubeconfig={kube}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports['scheduler']}",
            "--v=0",
        ],
        "kwok": [
            str(bin_dir / "kwok"),
            f"--kubeconfig={kube}",
            f"--config={run_dir / 'kwok-stages.yaml'}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}={KWOK_ANNOTATION_VALUE}",
            "--cidr=10.244.0.1/16",
            "--node-ip=10.0.0.1",
            f"--server-address=127.0.0.1:{ports['kwok']}",
        ],
    }


def scheduler_config(run_dir: Path) -> dict:
    """kube-scheduler's configuration: the bed's kubeconfig, client rate limits as large clusters
    set them, no leader election, and two profiles: the stock ``default-scheduler`` (what a pod
    gets unless it names another) and ``mixrl-packing`` (:mod:`mixrl.api.scheduling`), as a cluster
    whose administrator installed the chart's scheduler file serves them."""
    return scheduler_configuration(
        [{"schedulerName": DEFAULT_SCHEDULER}, packing_profile()],
        clientConnection={"kubeconfig": str(run_dir / "kubeconfig"), "qps": 200, "burst": 400},
        leaderElection={"leaderElect": False},
    )


AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "None", "users": ["admin"]}, {"level": "Metadata"}],
}


def storage_objects(volumes: int, size: str = "2Ti", volume_dir: Path | None = None) -> list[dict]:
    """A default StorageClass with no provisioner and pre-created PVs that claims bind to.  With
    ``volume_dir`` (a bed with real nodes) each PV is a directory there that pods really write;
    without, the PVs are never mounted (no kubelet)."""
    objects: list[dict] = [
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "Immediate",
            "allowVolumeExpansion": True,
        }
    ]
    for index in range(volumes):
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {
                    "name": f"{STORAGE_CLASS}-{index}",
                    "labels": {"mixrl.dev/simulated-volume": "true"},
                },
                "spec": {
                    "capacity": {"storage": size},
                    "accessModes": ["ReadWriteOnce", "ReadWriteMany"],
                    "storageClassName": STORAGE_CLASS,
                    "persistentVolumeReclaimPolicy": "Delete",
                    "hostPath": {
                        "path": str(volume_dir / str(index))
                        if volume_dir
                        else f"/tmp/mixrl-dev-volume-{index}",
                        "type": "Directory" if volume_dir else "DirectoryOrCreate",
                    },
                },
            }
        )
    return objects


class Cluster:
    def __init__(self, run_dir: Path | None = None):
        self.dir = Path(run_dir or default_dir())
        self.state_file = self.dir / "state.json"

    # ------------------------------------------------------------------ state

    def state(self) -> ClusterState | None:
        try:
            return ClusterState(**json.loads(self.state_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def running(self) -> dict[str, bool]:
        state = self.state()
        if state is None:
            return {}
        return {name: _owned(state, name) for name in state.pids}

    # ------------------------------------------------------------------ up

    def up(
        self,
        groups: list[NodeGroup],
        volumes: int = 8,
        timeout: float = 90.0,
        log: Callable[[str], None] = print,
        real_nodes: int = 0,
        with_images: bool = False,
    ) -> ClusterState:
        """Start the control plane, the KWOK fleet ``groups`` and ``real_nodes`` real CPU nodes;
        ``with_images``: build the project's images (``scripts/images.sh``, cached), import them into
        every real node and write ``chart-values.yaml`` for ``helm install -f``."""
        if any(self.running().values()):
            raise ClusterError(
                f"a test bed is already running in {self.dir} (`mixrl dev-cluster down` first)"
            )
        nodes = node_addresses(real_nodes)
        if nodes:
            # Before anything is built or cleaned: Network.up would take the other bed's network down.
            owner = network_owner()
            if owner is not None:
                raise ClusterError(
                    f"--real-nodes: the bed in {owner} runs real nodes (one bed at a time: their network's "
                    f"names are fixed): `mixrl dev-cluster --dir {owner} down` first"
                )
            _check_real_node_host()
        if self.state_file.exists():
            # No process of the state is the bed's (checked above): a reboot, or a crash without
            # `down`. What it left (data, mounts, cgroups, the network) goes as `down` removes it.
            log(f"dev-cluster: the bed in {self.dir} was not taken down; cleaning up what it left")
            self._take_down(log)
        started = time.monotonic()
        bin_dir = binaries_dir()
        wanted = COMPONENTS + (REAL_NODE_BINARIES if real_nodes else ())
        missing = [name for name in wanted if not (bin_dir / name).exists()]
        if missing:
            raise ClusterError(
                f"missing binaries in {bin_dir}: {', '.join(missing)} (run scripts/k8s-bin.sh)"
            )
        if with_images and not nodes:
            raise ClusterError(
                "--images: the project's images run only on real nodes (--real-nodes 1 or more)"
            )
        built = project_images() if with_images else []
        shutil.rmtree(self.dir / "etcd", ignore_errors=True)  # a fresh cluster each time
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        make_pki(self.dir / "pki")
        token = secrets.token_hex(16)
        (self.dir / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
        os.chmod(self.dir / "tokens.csv", 0o600)
        names = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")
        ports = dict(zip(names, free_ports(len(names)), strict=True))
        address = HOST_IP if nodes else "127.0.0.1"
        server = f"https://{address}:{ports['apiserver']}"
        (self.dir / "kubeconfig").write_text(
            yaml.safe_dump(kubeconfig(server, self.dir / "pki" / "ca.crt", token))
        )
        os.chmod(self.dir / "kubeconfig", 0o600)
        (self.dir / "kwok-stages.yaml").write_text(stages_yaml())
        (self.dir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        (self.dir / "kube-scheduler.yaml").write_text(
            yaml.safe_dump(scheduler_config(self.dir), sort_keys=False)
        )
        (self.dir / "logs" / "audit.log").unlink(missing_ok=True)
        state = ClusterState(str(self.dir), str(bin_dir), server, token, ports, {}, len(nodes), address,
                             starts={}, boot_id=_boot_id())  # fmt: skip
        commands = component_commands(bin_dir, self.dir, ports, address)
        try:
            if nodes:
                state.netns_before = _pod_netns()
                self._save(state)
                _claim_network(self.dir, os.getpid())  # this `up`, until the API server runs
                try:
                    Network(self.dir / "network.json").up(nodes)
                except NetworkError as exc:
                    raise ClusterError(f"--real-nodes: building the bed's network failed: {exc}") from exc
                log(f"dev-cluster: network {HOST_IP}/24 and {len(nodes)} node namespace(s) "
                    f"({time.monotonic() - started:.1f} s)")  # fmt: skip
            self._start(state, "etcd", commands["etcd"])
            self._wait(state, "etcd", lambda: _http_ok(f"http://127.0.0.1:{ports['etcd']}/health"), timeout)
            self._start(state, "kube-apiserver", commands["kube-apiserver"])
            if nodes:  # lives as long as the bed: the network's owner from now on
                _claim_network(self.dir, state.pids["kube-apiserver"])
            self._wait(state, "kube-apiserver", lambda: self._api_ok(state, "/readyz"), timeout)
            log(f"dev-cluster: API server ready at {server} ({time.monotonic() - started:.1f} s)")
            for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
                self._start(state, name, commands[name])
            fleet = fleet_nodes(groups)
            volume_dir = self.dir / "volumes" if nodes else None
            if volume_dir is not None:
                for index in range(volumes):  # pods run as uid 1000: the directories are theirs to write
                    (volume_dir / str(index)).mkdir(parents=True, exist_ok=True)
                    os.chmod(volume_dir / str(index), 0o1777)
            storage = storage_objects(volumes, volume_dir=volume_dir)
            self.kubectl(state, "create", "-f", "-", input=_yaml_list(fleet + storage))
            self._wait(state, "kwok", lambda: self._ready_nodes(state) >= len(fleet), timeout)
            self._wait(state, "kube-controller-manager", lambda: self._has_default_sa(state), timeout)
            self._wait(state, "kube-scheduler", lambda: _healthz(ports["scheduler"]), timeout)
            if nodes:
                self._start_real_nodes(state, nodes, timeout, log, built)
                self._start_prometheus(state, timeout, log)
        except BaseException:
            self.down(log=lambda _: None)
            raise
        real = f" ({len(nodes)} real)" if nodes else ""
        log(f"dev-cluster: {len(fleet) + len(nodes)} nodes Ready{real} in {time.monotonic() - started:.1f} s; "
            f"export KUBECONFIG={state.kubeconfig}")  # fmt: skip
        return state

    def _start_real_nodes(
        self,
        state: ClusterState,
        nodes: list[NodeAddress],
        timeout: float,
        log: Callable[[str], None],
        built: list[ProjectImage],
    ) -> None:
        """CoreDNS for the bed, then per node: containerd (with the bed's own images), the kubelet,
        kube-proxy and the NetworkPolicy enforcer; returns once every node is Ready."""
        started = time.monotonic()
        bin_dir = Path(state.bin)
        (self.dir / "Corefile").write_text(real_node.corefile(state.kubeconfig))
        self._start(state, "coredns", [str(bin_dir / "coredns"), "-conf", str(self.dir / "Corefile")])
        # (reference, archive, import even when present): the bed's own small images always (cheap,
        # and the host's busybox may change); the project's are tagged by content, so a present tag
        # is current and is not read again (gigabytes).
        archives: list[tuple[str, Path, bool]] = []
        for spec in images.node_images():
            path = self.dir / "images" / (spec.reference.replace("/", "_").replace(":", "_") + ".tar")
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(images.oci_archive(spec))
            archives.append((spec.reference, path, True))
        archives += [(image.reference, image.archive, False) for image in built]
        if built:
            (self.dir / "chart-values.yaml").write_text(yaml.safe_dump(chart_values(built), sort_keys=False))
        for node in nodes:
            make_node_pki(self.dir, node)
            real_node.write_node_files(self.dir, node, state.server, images.PAUSE_IMAGE)
            real_node.make_cgroups(node)
            commands = real_node.node_commands(bin_dir, self.dir, node)
            self._start(state, f"containerd-{node.index}", commands[f"containerd-{node.index}"])
            socket = real_node.containerd_socket(self.dir, node)
            answers = functools.partial(real_node.containerd_answers, socket)
            self._wait(state, f"containerd-{node.index}", answers, timeout)
            imported = time.monotonic()
            try:
                present = real_node.image_references(socket)
            except RuntimeError as exc:
                raise ClusterError(f"{node.name}: {exc}") from None
            for reference in sorted(present - {reference for reference, _, _ in archives}):
                if reference.startswith(images.BED_REGISTRY):
                    real_node.remove_image(socket, reference)  # an older build: containerd frees its layers
            wanted = [
                (reference, path)
                for reference, path, always in archives
                if always or reference not in present
            ]
            fresh = list(dict.fromkeys(path for _, path in wanted))  # the project's images share one archive
            for path in fresh:
                import_image(socket, path)
            log(f"dev-cluster: {len(wanted)} of {len(archives)} images imported into {node.name} "
                f"({time.monotonic() - imported:.1f} s; the others were in its cached store)")  # fmt: skip
            self._start(state, f"kubelet-{node.index}", commands[f"kubelet-{node.index}"])
            self._start(state, f"kube-proxy-{node.index}", commands[f"kube-proxy-{node.index}"])
            self._start(state, f"netpol-{node.index}", commands[f"netpol-{node.index}"])
        service = f"kubernetes.default.svc.{real_node.CLUSTER_DOMAIN}"
        self._wait(state, "coredns", lambda: _dns_answers(HOST_IP, service), timeout)
        for node in nodes:
            ready = functools.partial(self._node_ready, state, node.name)
            self._wait(state, f"kubelet-{node.index}", ready, timeout)
        # kube-proxy and the enforcer serve nothing the host reaches; seconds after their start,
        # once the nodes are Ready, they still run (a bad flag or configuration ends them at once).
        for node in nodes:
            for name in (f"kube-proxy-{node.index}", f"netpol-{node.index}"):
                if not _owned(state, name):
                    raise ClusterError(f"{name} exited while starting: {self.log_tail(name)}")
        log(f"dev-cluster: {len(nodes)} real node(s) Ready ({time.monotonic() - started:.1f} s)")

    def restart_node_agent(self, state: ClusterState, name: str) -> None:
        """Stop one real node's ``kubelet-<i>`` or ``kube-proxy-<i>`` and start it again, as an
        upgrade or a crash does; its containers keep running under containerd."""
        component, _, index = name.rpartition("-")
        nodes = {str(n.index): n for n in node_addresses(state.real_nodes)}
        if component not in ("kubelet", "kube-proxy") or index not in nodes:
            raise ClusterError(f"{name}: not a real node's kubelet or kube-proxy in this bed")
        _stop(state, [name])
        self._start(state, name, real_node.node_commands(Path(state.bin), self.dir, nodes[index])[name])

    def _start_prometheus(self, state: ClusterState, timeout: float, log: Callable[[str], None]) -> None:
        """Debian's Prometheus on the host, scraping the real nodes' pods, with the bed's stand-in for
        its Kubernetes service discovery (mixrl.devcluster.monitoring)."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise ClusterError(
                "--real-nodes: the prometheus binary is missing (scripts/setup.sh installs Debian's package)"
            )
        started = time.monotonic()
        directory = self.dir / "prometheus"
        shutil.rmtree(directory, ignore_errors=True)  # a fresh cluster, a fresh history
        directory.mkdir()
        targets = directory / "targets.json"
        targets.write_text("[]")
        placeholder = targets.stat().st_ino
        config = monitoring.prometheus_config(targets)
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self._start(
            state, "pod-discovery", monitoring.discovery_command(sys.executable, state.kubeconfig, targets)
        )
        self._start(state, "prometheus", monitoring.prometheus_command(binary, directory, state.address))
        url = f"http://{state.address}:{monitoring.PROMETHEUS_PORT}"
        self._wait(state, "prometheus", lambda: _http_ok(f"{url}/-/ready"), timeout)
        # pod-discovery writes its file anew (a rename: a new inode) once it listed the pods.
        self._wait(state, "pod-discovery", lambda: _inode(targets) not in (None, placeholder), timeout)
        self.kubectl(
            state, "create", "-f", "-", input=_yaml_list(monitoring.prometheus_objects(state.address))
        )
        log(f"dev-cluster: Prometheus at {url}, in the cluster {monitoring.SERVICE}.{monitoring.NAMESPACE}.svc:"
            f"{monitoring.PROMETHEUS_PORT} ({time.monotonic() - started:.1f} s)")  # fmt: skip

    def _node_ready(self, state: ClusterState, name: str) -> bool:
        try:
            return _schedulable(self.api_get(state, f"/api/v1/nodes/{name}"))
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def _save(self, state: ClusterState) -> None:
        self.state_file.write_text(json.dumps(asdict(state), indent=2))
        os.chmod(self.state_file, 0o600)  # it holds the admin token

    def _start(self, state: ClusterState, name: str, command: list[str]) -> None:
        log_file = open(self.dir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        log_file.close()
        _CHILDREN[process.pid] = process
        state.pids[name] = process.pid
        if state.starts is None:  # a state from an older mixrl: its other pids stay unchecked
            state.starts = {}
        state.boot_id = state.boot_id or _boot_id()
        # Our child, not yet waited for: its /proc entry stays even if it already exited.
        state.starts[name] = process_start(process.pid) or -1
        self._save(state)

    def _wait(self, state: ClusterState, name: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if name in state.pids and not _owned(state, name):
                raise ClusterError(f"{name} exited while starting: {self.log_tail(name)}")
            if ready():
                return
            time.sleep(0.2)
        raise ClusterError(f"{name} not ready after {timeout:.0f} s: {self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 3) -> str:
        try:
            text = (self.dir / "logs" / f"{name}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    # ------------------------------------------------------------------ API

    def _ssl(self, state: ClusterState) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(state.ca_file))

    def api_get(self, state: ClusterState, path: str, token: str | None = None) -> dict:
        request = urllib.request.Request(
            state.server + path, headers={"Authorization": f"Bearer {token or state.token}"}
        )
        with urllib.request.urlopen(request, context=self._ssl(state), timeout=5) as response:
            return json.loads(response.read() or b"{}")

    def _api_ok(self, state: ClusterState, path: str) -> bool:
        try:
            request = urllib.request.Request(
                state.server + path, headers={"Authorization": f"Bearer {state.token}"}
            )
            with urllib.request.urlopen(request, context=self._ssl(state), timeout=2) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _ready_nodes(self, state: ClusterState) -> int:
        try:
            nodes = self.api_get(state, "/api/v1/nodes")["items"]
        except (OSError, urllib.error.URLError, KeyError):
            return 0
        return sum(_schedulable(node) for node in nodes)

    def _has_default_sa(self, state: ClusterState) -> bool:
        try:
            self.api_get(state, "/api/v1/namespaces/default/serviceaccounts/default")
            return True
        except (OSError, urllib.error.URLError):
            return False

    def kubectl(self, state: ClusterState, *args: str, input: str | None = None) -> str:
        done = subprocess.run(
            [str(Path(state.bin) / "kubectl"), f"--kubeconfig={state.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args[:2])} failed: {done.stderr.strip()}")
        return done.stdout

    # ------------------------------------------------------------------ down, status

    def down(self, log: Callable[[str], None] = print) -> list[str]:
        """Stop every process of the test bed (TERM, then KILL) and remove its data; keep the logs.
        A pid of ``state.json`` that is not the bed's process any more (:func:`_owned`) is left alone."""
        stopped = self._take_down(log)
        log(f"dev-cluster: stopped {', '.join(stopped) or 'nothing (none running)'}")
        return stopped

    def _take_down(self, log: Callable[[str], None]) -> list[str]:
        """``down`` but its last line: the processes stopped."""
        state = self.state()
        stopped: list[str] = []
        if state is not None:
            if note := _not_the_beds(state):
                log(f"dev-cluster: {note}")
            order = list(reversed(state.pids))
            # The nodes' agents first, then their containers (while containerd still runs, so it
            # forgets them and its cached root keeps only images), then everything else.
            agents = [n for n in order if n.startswith(("netpol-", "kube-proxy-", "kubelet-"))]
            stopped += _stop(state, agents)
            for node in node_addresses(state.real_nodes):
                if _owned(state, f"containerd-{node.index}"):
                    real_node.drain_containerd(real_node.containerd_socket(self.dir, node))
            stopped += _stop(state, [n for n in order if n not in agents])
            for pid in state.pids.values():
                if (child := _CHILDREN.pop(pid, None)) is not None:
                    child.wait()
            self._clean_real_nodes(state, log)
            for directory in reversed(state.host_dirs):  # the deepest first; one in use is not empty
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
        for path in ("etcd", "state.json", "tokens.csv", "kubeconfig", "nodes", "volumes"):
            target = self.dir / path
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
        _release_network(self.dir)  # its processes are stopped: the network (if any) is free
        return stopped

    def _clean_real_nodes(self, state: ClusterState, log: Callable[[str], None]) -> None:
        """What the real nodes' processes leave behind once stopped: containers and their shims,
        mounts, cgroups, the pods' network namespaces, then the bed's network."""
        if state.real_nodes or (self.dir / "network.json").exists():
            owner = network_owner()
            if owner is not None and owner != str(self.dir.resolve()):
                # The node names, cgroups and network are the same in every bed: cleaning them
                # would take down the bed that took the network over since this one stopped.
                log(f"dev-cluster: the real-node network is the bed's in {owner} now: left to it")
                return
        for node in node_addresses(state.real_nodes):
            real_node.clean_node(self.dir, node)
        if state.netns_before is not None:
            for name in sorted(set(_pod_netns()) - set(state.netns_before)):
                subprocess.run(["umount", "-l", str(NETNS_DIR / name)], capture_output=True)
                (NETNS_DIR / name).unlink(missing_ok=True)
        if state.real_nodes or (self.dir / "network.json").exists():
            Network(self.dir / "network.json").down()

    def status(self) -> dict:
        state = self.state()
        if state is None:
            return {"running": False, "dir": str(self.dir)}
        alive = self.running()
        out: dict = {"running": all(alive.values()), "dir": str(self.dir), "server": state.server,
                     "kubeconfig": str(state.kubeconfig), "components": alive}  # fmt: skip
        if alive.get("kube-apiserver"):
            out["readyz"] = self._api_ok(state, "/readyz")
            out["ready_nodes"] = self._ready_nodes(state)
        return out


REAL_NODE_BINARIES = ("kubelet", "kube-proxy", "coredns")


def _stop(state: ClusterState, names: list[str]) -> list[str]:
    """TERM each named process group, KILL what is left after 10 s; return those that were running."""
    running = [name for name in names if _owned(state, name)]
    for name in running:
        _signal_group(state.pids[name], signal.SIGTERM)
    _wait_gone([state.pids[n] for n in running], 10, tick=0.1)
    killed = [name for name in running if _owned(state, name)]
    for name in killed:
        _signal_group(state.pids[name], signal.SIGKILL)
    # SIGKILL is not instant: return only once the kernel has taken them down.
    _wait_gone([state.pids[n] for n in killed], 10, tick=0.05)
    return running


def _wait_gone(pids: list[int], seconds: float, tick: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(tick)


def _check_real_node_host() -> None:
    """Real nodes need root (namespaces, cgroups, mounts) and the host's container runtime tools."""
    if os.geteuid() != 0:
        raise ClusterError("--real-nodes: needs root (network namespaces, cgroups and mounts)")
    absent = [tool for tool in real_node.HOST_TOOLS if shutil.which(tool) is None]
    if absent:
        raise ClusterError(
            f"--real-nodes: {', '.join(absent)} not found: scripts/setup.sh installs Debian's containerd, "
            "runc, containernetworking-plugins and nftables (as root)"
        )
    if not (real_node.CNI_BIN / "bridge").exists():
        raise ClusterError(
            f"--real-nodes: no CNI bridge plugin in {real_node.CNI_BIN} (containernetworking-plugins)"
        )


def import_image(socket: Path, archive: Path) -> None:
    """Load an OCI archive into the node's containerd, where the kubelet's pods find it."""
    done = subprocess.run(
        ["ctr", f"--address={socket}", "-n", "k8s.io", "images", "import", str(archive)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise ClusterError(f"importing {archive.name} into containerd failed: {done.stderr.strip()}")


def _pod_netns() -> list[str]:
    return sorted(p.name for p in NETNS_DIR.glob("cni-*")) if NETNS_DIR.exists() else []


def _schedulable(node: dict) -> bool:
    """Ready, and the node-lifecycle controller has lifted the not-ready taint."""
    conditions = node.get("status", {}).get("conditions", [])
    taints = node.get("spec", {}).get("taints", [])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and not any(t.get("key") == "node.kubernetes.io/not-ready" for t in taints)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if (child := _CHILDREN.get(pid)) is not None:
        return child.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie of another parent still answers kill(0)
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def process_start(pid: int) -> int | None:
    """When the process started, in clock ticks after boot: field 22 of ``/proc/<pid>/stat``.
    The fields are counted after the last ``)``: the command name before it (field 2) may hold
    spaces and parentheses."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 1 :].split()
    try:
        return int(fields[19])  # fields[0] is field 3 (the state)
    except (IndexError, ValueError):
        return None


def _boot_id() -> str | None:
    return _read(BOOT_ID)


def _is(pid: int, start: int | None, boot_id: str | None) -> bool:
    """``pid`` runs and is the process that started at ``start`` during boot ``boot_id``."""
    if start is None or boot_id is None or not _alive(pid):
        return False
    return boot_id == _boot_id() and process_start(pid) == start


def _owned(state: ClusterState, name: str) -> bool:
    """The bed's process ``name`` runs: its pid lives and is still the process the bed started,
    not one that got the pid after a reboot or a crash. A state that recorded no start time (an
    older mixrl's) cannot show it: False, so nothing signals a process that may be another's."""
    return _is(state.pids.get(name, 0), (state.starts or {}).get(name), state.boot_id)


def _not_the_beds(state: ClusterState) -> str | None:
    """One line on the live pids of ``state`` that ``down`` leaves alone, if any."""
    alien = [name for name, pid in state.pids.items() if _alive(pid) and not _owned(state, name)]
    if not alien:
        return None
    listed = ", ".join(f"{name} {state.pids[name]}" for name in alien)
    if state.starts is None or state.boot_id is None:
        return (f"state.json (an older mixrl's) records no start times, so its live pids ({listed}) cannot "
                "be told from other programs': not signalled; stop them yourself if they are the bed's")  # fmt: skip
    return (f"the pids of state.json are other programs' now (a reboot or a crash since `up`): {listed}; "
            "not signalled")  # fmt: skip


def network_owner() -> str | None:
    """The directory of the bed whose process, still running, built the real-node network."""
    try:
        owner = json.loads(NETWORK_OWNER.read_text())
        if _is(int(owner["pid"]), owner["start"], owner["boot_id"]):
            return str(owner["dir"])
    except (OSError, ValueError, TypeError, KeyError):
        pass  # none, or unreadable: nothing to protect
    return None


def _claim_network(bed: Path, pid: int) -> None:
    owner = {"dir": str(bed.resolve()), "pid": pid, "start": process_start(pid), "boot_id": _boot_id()}
    NETWORK_OWNER.write_text(json.dumps(owner))


def _release_network(bed: Path) -> None:
    """Forget the owner if it is this bed (another's, which took the network over, stays)."""
    try:
        owner = json.loads(NETWORK_OWNER.read_text())
    except (OSError, ValueError):
        return
    if isinstance(owner, dict) and owner.get("dir") == str(bed.resolve()):
        NETWORK_OWNER.unlink(missing_ok=True)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _healthz(port: int) -> bool:
    """kube-scheduler's /healthz on its secure port (anonymous: the path is always allowed)."""
    # Its serving certificate is one it makes itself at start, signed by no CA of the bed: only
    # whether it answers "ok" on loopback matters here.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        url = f"https://127.0.0.1:{port}/healthz"
        with urllib.request.urlopen(url, context=context, timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _dns_answers(server: str, name: str, port: int = 53) -> bool:
    """The DNS server at ``server`` answers an A query for ``name`` with at least one record."""
    query_id = secrets.randbits(16)
    header = struct.pack("!6H", query_id, 0x0100, 1, 0, 0, 0)  # recursion desired, one question
    labels = b"".join(bytes([len(label)]) + label.encode() for label in name.split("."))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(1)
        try:
            sock.sendto(header + labels + b"\0" + struct.pack("!2H", 1, 1), (server, port))  # A, IN
            reply = sock.recv(512)
        except OSError:
            return False
    if len(reply) < 12:
        return False
    answer_id, flags, _, answers = struct.unpack("!4H", reply[:8])
    return answer_id == query_id and bool(flags & 0x8000) and flags & 0xF == 0 and answers > 0


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _yaml_list(objects: list[dict]) -> str:
    return yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}, sort_keys=False)
