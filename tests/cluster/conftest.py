"""End-to-end tests on a real Kubernetes control plane (``mixrl dev-cluster``).

Real: etcd, kube-apiserver (RBAC, Pod Security and ResourceQuota admission, CRD structural schemas
and CEL rules, server-side apply, the scale subresource), kube-controller-manager (garbage
collector, Deployment/ReplicaSet/StatefulSet controllers, HPA, PV binder), kube-scheduler, the KWOK
controller, the real kubectl and Helm CLIs, and the operator as a separate process logged in with
a TokenRequest token of the chart's ServiceAccount (so the chart's RBAC is what it gets).
Stand-in: the nodes and pods are KWOK's (no kubelet, no containers): a pod is Running once
scheduled. One control plane serves the whole session; each test works in its own namespace.

These tests never skip: without the binaries (scripts/k8s-bin.sh builds them) they fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_TABLE
from mixrl.devcluster.addons import (
    kueue_queue_objects,
    start_addon,
    start_keda,
    stop_addon,
    stop_keda,
    wait_established,
)
from mixrl.devcluster.cluster import Cluster, ClusterState, kubeconfig
from mixrl.devcluster.kwok_fleet import parse_fleet

ROOT = Path(__file__).resolve().parents[2]
CHART = Path(os.environ.get("MIXRL_TEST_CHART", ROOT / "charts" / "mixrl"))  # another chart: for bisecting
RELEASE, RELEASE_NS = "mixrl", "mixrl-system"
# The paper's mix with room for two example trainers (4 x 8 H200 GPUs each: one still going away
# while the next test's arrives) and CPU nodes.
CRDS = ("rlruns.mixrl.dev", "samplerpools.mixrl.dev")
# Pre-created PVs are used once (no provisioner recycles them) and a run claims 6: room for the session.
VOLUMES = 300
FLEET = "H200=10,H100=3,B200=3,B300=2,A100=2,RTX-PRO-6000=2,cpu=3"


@dataclass
class Bed:
    state: ClusterState
    handle: Cluster

    @property
    def bin(self) -> Path:
        return Path(self.state.bin)

    def run(self, tool: str, *args: str, input: str | None = None, check: bool = True,
            kubeconfig_file: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig_file or self.state.kubeconfig),
            "HOME": str(self.home),
        }
        done = subprocess.run(
            [str(self.bin / tool), *args],
            input=input,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, input=input, check=check)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("helm", *args, check=check, timeout=300)

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def gpu_nodes(self, gpu_type: str) -> list[str]:
        """The nodes whose GPU Feature Discovery product label is one of ``gpu_type``'s, by name."""
        products = GPU_TABLE[gpu_type].gfd_products
        return [
            n["metadata"]["name"]
            for n in self.get("nodes")["items"]
            if n["metadata"]["labels"].get(GPU_PRODUCT_LABEL) in products
        ]

    def apply(self, obj: dict[str, Any] | str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
        text = obj if isinstance(obj, str) else yaml.safe_dump(obj)
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=text, check=check)

    @property
    def home(self) -> Path:
        path = Path(self.state.dir) / "home"  # helm's cache and config stay inside the run directory
        path.mkdir(exist_ok=True)
        return path

    def audit_events(self) -> list[dict[str, Any]]:
        """Audited requests so far: every one not made by the test-bed admin."""
        with contextlib.suppress(FileNotFoundError):
            return [
                json.loads(line) for line in self.state.audit_log.read_text().splitlines() if line.strip()
            ]
        return []


_TRUTHY = object()


def wait_for(
    condition: Callable[[], Any],
    timeout: float = 60,
    interval: float = 0.5,
    what: str = "condition",
    equals: Any = _TRUTHY,
) -> Any:
    """Poll until ``condition()`` is truthy (or equals ``equals``); fail naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    value: Any = None
    while time.monotonic() < deadline:
        value = condition()
        if (value == equals) if equals is not _TRUTHY else value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {value!r}")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    """The control plane and fleet, with the mixrl chart installed by Helm (CRDs, RBAC, operator
    Deployment) in ``mixrl-system``."""
    handle = Cluster(tmp_path_factory.mktemp("dev-cluster"))
    state = handle.up(parse_fleet(FLEET), volumes=VOLUMES, log=lambda line: print(line, file=sys.stderr))
    bed = Bed(state, handle)
    try:
        bed.helm(
            "install",
            RELEASE,
            str(CHART),
            "-n",
            RELEASE_NS,
            "--create-namespace",
            "--wait",
            "--timeout",
            "120s",
            "--set",
            "watch.allNamespaces=true",  # the chart is namespaced by default; these tests make namespaces as they go
        )
        wait_established(handle, bed.state, list(CRDS))
        yield bed
    finally:
        handle.down(log=lambda _: None)


@pytest.fixture(scope="module")
def kueue(cluster: Bed) -> Iterator[Bed]:
    """Kueue (v0.17, built from its Go module by scripts/k8s-addons.sh) running beside the shared
    bed's control plane, with a ResourceFlavor per GPU type of the fleet and the ClusterQueue
    ``mixrl`` holding the fleet's GPUs (mixrl.devcluster.addons).  Started only for the modules
    that ask, and stopped after them (its webhooks withdrawn): a manager left running beside the
    later tests' operators slowed the control-plane lane."""
    start_addon(cluster.handle, cluster.state, "kueue", log=lambda line: print(line, file=sys.stderr))
    cluster.apply(yaml.safe_dump_all(kueue_queue_objects(parse_fleet(FLEET))))
    yield cluster
    stop_addon(cluster.handle, cluster.state, "kueue")


@pytest.fixture(scope="module")
def keda(cluster: Bed) -> Iterator[Bed]:
    """KEDA (v2.21, its operator and metrics server built from its Go module by
    scripts/k8s-addons.sh) running beside the shared bed's control plane, its metrics server
    registered as the external metrics API through the API server's aggregation layer
    (mixrl.devcluster.addons.start_keda).  Started only for the modules that ask, stopped after
    them (the APIService withdrawn)."""
    start_keda(cluster.handle, cluster.state, log=lambda line: print(line, file=sys.stderr))
    yield cluster
    stop_keda(cluster.handle, cluster.state)


@pytest.fixture
def namespace(cluster: Bed) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    # A namespace with pods is waited for, so the next test finds their GPUs free (a few seconds);
    # an empty one (most admission tests) is not.
    has_pods = cluster.kubectl("get", "pods", "-n", name, "-o", "name", check=False).stdout.strip()
    wait = "--wait=true" if has_pods else "--wait=false"
    cluster.kubectl("delete", "namespace", name, wait, "--timeout=90s", check=False)


def service_account_kubeconfig(cluster: Bed, path: Path, namespace: str, account: str) -> Path:
    """A kubeconfig holding a TokenRequest token of ``namespace/account`` (what a pod would mount)."""
    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration=6h").stdout.strip()
    config = kubeconfig(cluster.state.server, cluster.state.ca_file, token, user=f"{namespace}:{account}")
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class OperatorProcess:
    process: subprocess.Popen[bytes]
    log: Path
    user: str
    """The operator's user name as the API server sees it (for counting its requests)."""

    def requests(self, cluster: Bed) -> list[dict[str, Any]]:
        return [e for e in cluster.audit_events() if e.get("user", {}).get("username") == self.user]

    def writes(self, cluster: Bed, since: int = 0) -> list[dict[str, Any]]:
        return [
            e
            for e in self.requests(cluster)[since:]
            if e.get("verb") in ("create", "update", "patch", "delete", "deletecollection")
        ]

    def denied(self, cluster: Bed) -> list[str]:
        """Requests RBAC refused (a quota's or admission's 403 is not RBAC's and not counted)."""
        return [
            f"{e['verb']} {e['requestURI']}"
            for e in self.requests(cluster)
            if e.get("annotations", {}).get("authorization.k8s.io/decision") == "forbid"
        ]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def chart_operator_args(
    cluster: Bed, pod_name: str, release: str = RELEASE, namespace: str = RELEASE_NS
) -> list[str]:
    """The arguments the installed chart gives its operator container (``$(POD_NAME)`` filled in;
    the liveness endpoint dropped, as several operators share this machine's ports)."""
    deployment = cluster.get(f"deployment/{release}", "-n", namespace)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = [arg.replace("$(POD_NAME)", pod_name) for arg in container["args"]]
    return [arg for arg in args if not arg.startswith("--liveness")]


def start_operator(cluster: Bed, workdir: Path, *extra: str, name: str = "operator") -> OperatorProcess:
    """The chart's operator as a local process: the installed Deployment's arguments, logged in
    with a TokenRequest token of the chart's ServiceAccount. ``extra`` arguments are appended (a
    ``--replica-id`` among them replaces the chart's)."""
    account = RELEASE  # the chart's service account defaults to the release's full name
    config = service_account_kubeconfig(cluster, workdir / f"{name}.kubeconfig", RELEASE_NS, account)
    args = chart_operator_args(cluster, pod_name=f"{RELEASE}-{name}")
    if any(arg.startswith("--replica-id") for arg in extra):
        args = [arg for arg in args if not arg.startswith("--replica-id")]
    log = workdir / f"{name}.log"
    env = {**os.environ, "KUBECONFIG": str(config)}
    with log.open("wb") as out:  # the child has its own copy of the descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", "mixrl.cli", "operator", *args, *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return OperatorProcess(process, log, f"system:serviceaccount:{RELEASE_NS}:{account}")


def stop_operator(operator: OperatorProcess) -> None:
    with contextlib.suppress(ProcessLookupError):
        operator.process.terminate()
    try:
        operator.process.wait(15)
    except subprocess.TimeoutExpired:
        operator.process.kill()
        operator.process.wait()


def feature_rbac(cluster: Bed, value: str, suffix: str) -> str:
    """The chart's ClusterRole and binding of a feature that reads cluster-wide (``value``, e.g.
    ``placement.explain=true``; their names end in ``suffix``), rendered by Helm as an upgrade would
    add them to the installed release (whose other values stay as the bed has them)."""
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    rendered = cluster.helm(
        "template", RELEASE, str(CHART), "-n", RELEASE_NS, "--kube-version", version,
        "--set", "watch.allNamespaces=true", "--set", value, "--show-only", "templates/rbac.yaml",
    ).stdout  # fmt: skip
    ours = [d for d in yaml.safe_load_all(rendered) if d and d["metadata"]["name"].endswith(suffix)]
    assert [d["kind"] for d in ours] == ["ClusterRole", "ClusterRoleBinding"], ours
    return yaml.safe_dump_all(ours)


@contextlib.contextmanager
def operator_with_feature(
    cluster: Bed, workdir: Path, value: str, suffix: str, *flags: str
) -> Iterator[OperatorProcess]:
    """The chart's operator with ``flags`` and the chart's RBAC of the feature (:func:`feature_rbac`),
    withdrawn after it; no call of it may have been refused."""
    rbac = feature_rbac(cluster, value, suffix)
    cluster.apply(rbac)
    running = start_operator(cluster, workdir, *flags)
    try:
        yield running
    finally:
        stop_operator(running)
        print(f"--- operator log (last lines)\n{running.log_tail()}", file=sys.stderr)
        cluster.kubectl("delete", "-f", "-", "--wait=false", input=rbac, check=False)
    assert not running.denied(cluster), running.denied(cluster)


@pytest.fixture(scope="module")
def operator(cluster: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    running = start_operator(cluster, tmp_path_factory.mktemp("operator"))
    try:
        yield running
    finally:
        stop_operator(running)
        print(f"--- operator log (last lines)\n{running.log_tail()}", file=sys.stderr)
    assert not running.denied(cluster), "calls the chart's RBAC refused: " + ", ".join(
        running.denied(cluster)
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A skipped cluster test is a failure: CI must not pass without the control plane."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"cluster tests must not skip: {report.longrepr}"


def exposition_server(render: Callable[[], str], port: int) -> ThreadingHTTPServer:
    """A loopback ``/metrics`` that answers ``render()`` in Prometheus' text format (not started:
    run its ``serve_forever`` in a thread): the test bed's stand-in for components that KWOK pods
    do not run."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that ends the real-node bed runs last, whatever file it is in."""
    items.sort(key=lambda item: item.get_closest_marker("ends_real_bed") is not None)


@pytest.fixture(scope="session")
def real_bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    """A second control plane with one real CPU node (kubelet, containerd, kube-proxy, CoreDNS),
    the project's images imported into it and no KWOK fleet, so every pod scheduled here really
    runs. Its own bed: on the shared one a CPU pod could land on a KWOK CPU node and never start.
    Real nodes use the bed's fixed bridge and namespaces, so one such bed runs at a time; the test
    marked ``ends_real_bed`` stops it last."""
    handle = Cluster(tmp_path_factory.mktemp("real-bed"))
    state = handle.up(
        [], volumes=40, real_nodes=1, with_images=True, log=lambda line: print(line, file=sys.stderr)
    )
    try:
        yield Bed(state, handle)
    finally:
        handle.down(log=lambda _: None)


@pytest.fixture(scope="session")
def real_chart(real_bed: Bed) -> Bed:
    """The chart installed on the real-node bed with the bed's images (its chart-values.yaml), the
    operator running as the chart's pod and watching every namespace: what the README's newcomer
    path does. Every real-run module shares it; each run lives in a namespace of its own."""
    values = Path(real_bed.state.dir) / "chart-values.yaml"
    real_bed.helm("install", RELEASE, str(CHART), "-n", RELEASE_NS, "--create-namespace", "--wait",
                  "--timeout", "300s", "-f", str(values), "--set", "watch.allNamespaces=true")  # fmt: skip
    return real_bed
