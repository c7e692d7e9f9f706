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
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from mixrl.devcluster.fleet import KWOK_ANNOTATION, KWOK_ANNOTATION_VALUE, NodeGroup, fleet_nodes
from mixrl.devcluster.stages import stages_yaml

REPO = Path(__file__).resolve().parents[2]
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
SERVICE_CIDR = "10.96.0.0/16"
STORAGE_CLASS = "mixrl-dev"


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ClusterState:
    """What ``up`` wrote to ``state.json``: enough for ``status``, ``down`` and the tests."""

    dir: str
    bin: str
    server: str
    token: str
    ports: dict[str, int]
    pids: dict[str, int]

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


def make_pki(pki: Path) -> None:
    """A CA, the API server's serving certificate (loopback and in-cluster names) and the
    service-account signing key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    if (pki / "sa.pub").exists():
        return
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj", "/CN=mixrl-dev-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=pki)  # fmt: skip
    san = "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver", "-addext", san,
             "-keyout", "apiserver.key", "-out", "apiserver.csr", cwd=pki)  # fmt: skip
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "3650", "-copy_extensions", "copyall", "-out", "apiserver.crt", cwd=pki)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


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


def component_commands(bin_dir: Path, run_dir: Path, ports: dict[str, int]) -> dict[str, list[str]]:
    """The command line of every control-plane process (pure; ``up`` starts them in this order)."""
    pki, kube = run_dir / "pki", str(run_dir / "kubeconfig")
    etcd = f"http://127.0.0.1:{ports['etcd']}"
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
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            "--endpoint-reconciler-type=none",  # a loopback address cannot back the kubernetes Service
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
            # The defaults (NamespaceLifecycle, LimitRanger, ServiceAccount, PodSecurity,
            # ResourceQuota, DefaultStorageClass, the admission webhooks…), named so a reader sees them.
            "--enable-admission-plugins=NamespaceLifecycle,LimitRanger,ServiceAccount,PodSecurity,"
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
            "--leader-elect=false",
            "--v=0",
        ],
        "kube-scheduler": [
            str(bin_dir / "kube-scheduler"),
            f"--kubeconfig={kube}",
            f"--authentication-kubeconfig={kube}",
            f"--authorization-kubeconfig={kube}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports['scheduler']}",
            "--leader-elect=false",
            "--kube-api-qps=200",
            "--kube-api-burst=400",
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


AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "None", "users": ["admin"]}, {"level": "Metadata"}],
}


def storage_objects(volumes: int, size: str = "2Ti") -> list[dict]:
    """A default StorageClass with no provisioner and pre-created PVs that claims bind to."""
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
                    "hostPath": {"path": f"/tmp/mixrl-dev-volume-{index}"},  # never written: no kubelet
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
        return {name: _alive(pid) for name, pid in state.pids.items()}

    # ------------------------------------------------------------------ up

    def up(
        self,
        groups: list[NodeGroup],
        volumes: int = 8,
        timeout: float = 90.0,
        log: Callable[[str], None] = print,
    ) -> ClusterState:
        if any(self.running().values()):
            raise ClusterError(
                f"a test bed is already running in {self.dir} (`mixrl dev-cluster down` first)"
            )
        started = time.monotonic()
        bin_dir = binaries_dir()
        missing = [name for name in COMPONENTS if not (bin_dir / name).exists()]
        if missing:
            raise ClusterError(
                f"missing binaries in {bin_dir}: {', '.join(missing)} (run scripts/k8s-bin.sh)"
            )
        shutil.rmtree(self.dir / "etcd", ignore_errors=True)  # a fresh cluster each time
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        make_pki(self.dir / "pki")
        token = secrets.token_hex(16)
        (self.dir / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
        os.chmod(self.dir / "tokens.csv", 0o600)
        ports = {
            name: free_port()
            for name in ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")
        }
        server = f"https://127.0.0.1:{ports['apiserver']}"
        (self.dir / "kubeconfig").write_text(
            yaml.safe_dump(kubeconfig(server, self.dir / "pki" / "ca.crt", token))
        )
        os.chmod(self.dir / "kubeconfig", 0o600)
        (self.dir / "kwok-stages.yaml").write_text(stages_yaml())
        (self.dir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        (self.dir / "logs" / "audit.log").unlink(missing_ok=True)
        state = ClusterState(str(self.dir), str(bin_dir), server, token, ports, {})
        commands = component_commands(bin_dir, self.dir, ports)
        try:
            self._start(state, "etcd", commands["etcd"])
            self._wait(state, "etcd", lambda: _http_ok(f"http://127.0.0.1:{ports['etcd']}/health"), timeout)
            self._start(state, "kube-apiserver", commands["kube-apiserver"])
            self._wait(state, "kube-apiserver", lambda: self._api_ok(state, "/readyz"), timeout)
            log(f"dev-cluster: API server ready at {server} ({time.monotonic() - started:.1f} s)")
            for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
                self._start(state, name, commands[name])
            nodes = fleet_nodes(groups)
            self.kubectl(state, "create", "-f", "-", input=_yaml_list(nodes + storage_objects(volumes)))
            self._wait(state, "kwok", lambda: self._ready_nodes(state) >= len(nodes), timeout)
            self._wait(state, "kube-controller-manager", lambda: self._has_default_sa(state), timeout)
        except BaseException:
            self.down(log=lambda _: None)
            raise
        log(f"dev-cluster: {len(nodes)} nodes Ready in {time.monotonic() - started:.1f} s; "
            f"export KUBECONFIG={state.kubeconfig}")  # fmt: skip
        return state

    def _start(self, state: ClusterState, name: str, command: list[str]) -> None:
        log_file = open(self.dir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        log_file.close()
        _CHILDREN[process.pid] = process
        state.pids[name] = process.pid
        self.state_file.write_text(json.dumps(asdict(state), indent=2))
        os.chmod(self.state_file, 0o600)  # it holds the admin token

    def _wait(self, state: ClusterState, name: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _alive(state.pids.get(name, 0)) and name in state.pids:
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
        """Stop every process of the test bed (TERM, then KILL) and remove its data; keep the logs."""
        state = self.state()
        stopped: list[str] = []
        if state is not None:
            for name in reversed(COMPONENTS):
                pid = state.pids.get(name)
                if pid and _alive(pid):
                    _signal_group(pid, signal.SIGTERM)
                    stopped.append(name)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(_alive(state.pids.get(n, 0)) for n in stopped):
                time.sleep(0.1)
            killed = [name for name in stopped if _alive(state.pids[name])]
            for name in killed:
                _signal_group(state.pids[name], signal.SIGKILL)
            # SIGKILL is not instant: return only once the kernel has taken them down.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(_alive(state.pids[n]) for n in killed):
                time.sleep(0.05)
            for pid in state.pids.values():
                if (child := _CHILDREN.pop(pid, None)) is not None:
                    child.wait()
        for path in ("etcd", "state.json", "tokens.csv", "kubeconfig"):
            target = self.dir / path
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
        log(f"dev-cluster: stopped {', '.join(stopped) or 'nothing (none running)'}")
        return stopped

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


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _yaml_list(objects: list[dict]) -> str:
    return yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}, sort_keys=False)
