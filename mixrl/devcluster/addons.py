"""Cluster add-ons on the test bed: Kueue, LeaderWorkerSet and KEDA, built from their pinned Go
modules (``scripts/k8s-addons.sh``), each run as local processes beside the bed's control plane, as
the bed runs kube-scheduler and KWOK.

What their release manifests would install in a real cluster is applied from the module's own
``config/`` directory, rewritten for a manager that runs outside the cluster:

- the CRDs (``kubectl apply --server-side``), with the conversion webhooks their kustomization
  enables pointed at the manager on loopback;
- the Mutating/ValidatingWebhookConfigurations, with the patches of their kustomization applied
  (LeaderWorkerSet's pod webhooks get their object selector that way) and every ``service``
  reference replaced by ``url: https://127.0.0.1:<port>/<path>`` and the bed CA's bundle;
- no Deployment, Service or RBAC: the manager is a process logged in with the bed's admin
  kubeconfig, its webhook server on loopback with a certificate the bed's CA signs
  (``internalCertManagement`` off: the managers' own rotator would issue certificates for an
  in-cluster Service name the API server could not reach here).

The process is recorded in the bed's ``state.json`` like every other one, so ``down`` stops it;
its log is ``<bed>/logs/<name>.log``, its files (configuration, certificates, the manifests as
applied) are in ``<bed>/addons/<name>/``.

KEDA (:func:`start_keda`) is two processes, its operator and its metrics server, the latter
registered as the ``v1beta1.external.metrics.k8s.io`` APIService through the API server's
aggregation layer, so the HPA controller reads ScaledObjects' triggers as on a real cluster.

Kueue's queues for the bed's fleet (:func:`kueue_queue_objects`): a ResourceFlavor per GPU type
(the node labels GPU Feature Discovery puts on that type's nodes, and the GPU taint), a ``default``
flavor for CPU and memory, and a ClusterQueue whose GPU quota per flavour is the fleet's GPUs of
that type.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import os
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_RESOURCE, GPU_TABLE
from mixrl.devcluster.cluster import (
    EC_KEY,
    REPO,
    Cluster,
    ClusterError,
    ClusterState,
    _stop,
    free_ports,
    issue_certificate,
)
from mixrl.devcluster.kwok_fleet import GPU_TAINT, NodeGroup

KUEUE_API = "kueue.x-k8s.io/v1beta2"
"""The Kueue API the bed's objects use (Kueue v0.17 stores v1beta2)."""


@dataclass(frozen=True)
class AddonSpec:
    """How one add-on's manager runs out of cluster, and which of its manifests the bed applies."""

    name: str
    """Its name in ``scripts/k8s-addons.sh`` (and the binary's, under ``bin/``)."""
    namespace: str
    """The namespace its release manifests install into (its manager keeps state there)."""
    config_api: str
    """apiVersion of its manager's Configuration file."""
    crd_dir: str
    """The kustomization (under ``config/``) of its CRDs and their conversion-webhook patches."""
    webhook_dir: str
    """The kustomization of its Mutating/ValidatingWebhookConfigurations."""
    webhook_groups: tuple[str, ...] | None = None
    """Keep only webhooks whose rules name these API groups alone (None: every webhook).  Kueue's
    manifests also hook every Pod, Job, Deployment and StatefulSet for its job integrations, which
    the bed does not use: those would put every other test's pods through Kueue."""
    configuration: dict[str, Any] = field(default_factory=dict)
    """Extra fields of its Configuration."""
    args: tuple[str, ...] = ()
    metrics_cert_dir: str | None = None
    """A fixed path where the manager reads its metrics certificate when its own certificate
    management is off (Kueue v0.17: ``/etc/kueue/metrics/certs``, not configurable)."""


ADDONS: dict[str, AddonSpec] = {
    "kueue": AddonSpec(
        name="kueue",
        namespace="kueue-system",
        config_api="config.kueue.x-k8s.io/v1beta2",
        crd_dir="components/crd",
        webhook_dir="components/webhook",
        webhook_groups=("kueue.x-k8s.io",),
        configuration={
            "namespace": "kueue-system",
            # Kueue refuses an empty list; batch/job is the smallest integration (no Job here
            # names a queue, and its webhooks are not installed).
            "integrations": {"frameworks": ["batch/job"]},
            # The on-demand visibility API is an aggregated API server: not needed on the bed.
            "featureGates": {"VisibilityOnDemand": False},
        },
        metrics_cert_dir="/etc/kueue/metrics/certs",
    ),
    "lws": AddonSpec(
        name="lws",
        namespace="lws-system",
        config_api="config.lws.x-k8s.io/v1alpha1",
        crd_dir="crd",
        webhook_dir="webhook",
    ),
}


KEDA = "keda"
"""KEDA is built by the same script but runs two processes of its own (:func:`start_keda`)."""


def addon_dir(name: str) -> Path:
    """The add-on's build (``bin/<binary>`` and the module's ``config/``), made or found by
    ``scripts/k8s-addons.sh``."""
    if name not in ADDONS and name != KEDA:
        raise ClusterError(f"unknown add-on {name!r} (known: {', '.join([*ADDONS, KEDA])})")
    script = REPO / "scripts" / "k8s-addons.sh"
    done = subprocess.run([str(script), name], stdout=subprocess.PIPE, text=True)  # progress: stderr
    if done.returncode != 0:
        raise ClusterError(f"scripts/k8s-addons.sh {name} failed (see its output above)")
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == name:
            return Path(parts[1])
    raise ClusterError(f"scripts/k8s-addons.sh {name} printed no directory")


# ----------------------------------------------------------------------------- manifests (pure)


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text()) or {}


def crd_manifests(config: Path, spec: AddonSpec, webhook_url: str, ca_bundle: str) -> list[dict[str, Any]]:
    """The add-on's CRDs as its kustomization lists them, with the conversion webhooks it enables
    (``patches/webhook_in_*.yaml``) served at ``webhook_url`` + the patch's path."""
    directory = config / spec.crd_dir
    kustomization = _kustomization(directory)
    crds = [
        doc for resource in kustomization.get("resources", []) for doc in _documents(directory / resource)
    ]
    by_name = {crd["metadata"]["name"]: crd for crd in crds}
    for patch in kustomization.get("patches") or []:
        for doc in _documents(directory / patch["path"]):
            conversion = (doc.get("spec") or {}).get("conversion")
            target = by_name.get(doc["metadata"]["name"])
            if target is None or not conversion or conversion.get("strategy") != "Webhook":
                continue
            webhook = copy.deepcopy(conversion["webhook"])
            path = webhook["clientConfig"].get("service", {}).get("path", "/convert")
            webhook["clientConfig"] = {"url": webhook_url + path, "caBundle": ca_bundle}
            target["spec"]["conversion"] = {"strategy": "Webhook", "webhook": webhook}
    return crds


def _json_patch(obj: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """The RFC 6902 operations kustomize patches use on webhook lists (add, replace, remove)."""
    for op in ops:
        keys = [int(k) if k.isdigit() else k for k in op["path"].strip("/").split("/")]
        parent: Any = obj
        for key in keys[:-1]:
            parent = parent[key]
        last = keys[-1]
        if op["op"] == "remove":
            del parent[last]
        elif op["op"] == "add" and isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else int(last), op["value"])
        else:
            parent[last] = op["value"]


def _merge_webhooks(obj: dict[str, Any], patch: dict[str, Any]) -> None:
    """A strategic-merge patch of a webhook configuration: webhooks merged by name."""
    by_name = {hook["name"]: hook for hook in obj.get("webhooks", [])}
    for hook in patch.get("webhooks", []):
        if hook["name"] in by_name:
            by_name[hook["name"]].update(copy.deepcopy(hook))


def _kept(hook: dict[str, Any], groups: tuple[str, ...] | None) -> bool:
    if groups is None:
        return True
    named = {group for rule in hook.get("rules", []) for group in rule.get("apiGroups", [])}
    return bool(named) and named <= set(groups)


def webhook_manifests(
    config: Path, spec: AddonSpec, webhook_url: str, ca_bundle: str
) -> list[dict[str, Any]]:
    """The add-on's webhook configurations with their kustomization's patches applied, named as its
    release names them (``<name>-`` prefix), each webhook calling ``webhook_url`` + its path."""
    directory = config / spec.webhook_dir
    kustomization = _kustomization(directory)
    configs = [
        doc
        for resource in kustomization.get("resources", [])
        for doc in _documents(directory / resource)
        if doc.get("kind") in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
    ]
    by_kind = {doc["kind"]: doc for doc in configs}
    for entry in kustomization.get("patches") or []:
        if "path" in entry:
            loaded = yaml.safe_load((directory / entry["path"]).read_text())
        else:
            loaded = yaml.safe_load(entry["patch"])
        if isinstance(loaded, list):  # JSON 6902, aimed by its target
            target = by_kind.get(entry.get("target", {}).get("kind", ""))
            if target is not None:
                _json_patch(target, loaded)
        elif isinstance(loaded, dict) and loaded.get("kind") in by_kind:
            _merge_webhooks(by_kind[loaded["kind"]], loaded)
    out = []
    for doc in configs:
        hooks = []
        for hook in doc.get("webhooks", []):
            if not _kept(hook, spec.webhook_groups):
                continue
            hook = copy.deepcopy(hook)
            path = hook["clientConfig"].get("service", {}).get("path", "/")
            hook["clientConfig"] = {"url": webhook_url + path, "caBundle": ca_bundle}
            hooks.append(hook)
        out.append(
            {
                "apiVersion": doc["apiVersion"],
                "kind": doc["kind"],
                "metadata": {"name": f"{spec.name}-{doc['metadata']['name']}"},
                "webhooks": hooks,
            }
        )
    return out


def manager_configuration(spec: AddonSpec, ports: dict[str, int], cert_dir: Path) -> dict[str, Any]:
    """The manager's Configuration: webhook server and health probes on loopback, its certificate
    from ``cert_dir``, no leader election, no certificate management of its own, metrics off."""
    return {
        "apiVersion": spec.config_api,
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['health']}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": ports["webhook"], "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        **copy.deepcopy(spec.configuration),
    }


def manager_command(
    spec: AddonSpec, binary: Path, config_file: Path, kubeconfig: Path, cert_dir: Path
) -> list[str]:
    """The manager's command line, with the bed's admin kubeconfig.  Kueue reads its metrics
    certificate from a fixed path: it runs in a mount namespace of its own where the bed's
    certificate directory is bound there (the host's path is left an empty directory)."""
    command = ["env", f"KUBECONFIG={kubeconfig}", str(binary), f"--config={config_file}", *spec.args]
    if spec.metrics_cert_dir is None:
        return command
    bind = 'mount --bind "$0" "$1" && shift && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", bind, str(cert_dir),
            spec.metrics_cert_dir, *command]  # fmt: skip


# ----------------------------------------------------------------------------- start, stop


@dataclass(frozen=True)
class RunningAddon:
    name: str
    directory: Path
    """``<bed>/addons/<name>``: configuration, certificates, the manifests as applied."""
    webhook_url: str
    log: Path


def _webhook_answers(port: int, ca_file: Path) -> bool:
    context = ssl.create_default_context(cafile=str(ca_file))
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=2) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1"),
        ):
            return True
    except (OSError, ssl.SSLError):
        return False


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def start_addon(
    handle: Cluster,
    state: ClusterState,
    name: str,
    timeout: float = 120.0,
    log: Callable[[str], None] = print,
) -> RunningAddon:
    """Build (or find) the add-on, apply its CRDs and webhook configurations and start its manager
    against the bed; returns once its webhooks answer and its CRDs are served."""
    spec = ADDONS.get(name)
    if spec is None:
        raise ClusterError(f"unknown add-on {name!r} (known: {', '.join(ADDONS)})")
    if name in state.pids and handle.running().get(name):
        raise ClusterError(f"{name} already runs on this bed")
    if spec.metrics_cert_dir is not None and os.geteuid() != 0:
        # Checked before the build: the mount point and `unshare --mount` need root.
        raise ClusterError(f"--{name}: needs root (its manager reads {spec.metrics_cert_dir}, bound there in a "
                           "mount namespace of its own)")  # fmt: skip
    started = time.monotonic()
    build = addon_dir(name)
    directory = Path(state.dir) / "addons" / name
    cert_dir = directory / "certs"
    issue_certificate(Path(state.dir) / "pki", cert_dir, "tls", f"/CN={name}-webhook", san="IP:127.0.0.1")
    ca_bundle = base64.b64encode(state.ca_file.read_bytes()).decode()
    webhook_port, health_port = free_ports(2)
    webhook_url = f"https://127.0.0.1:{webhook_port}"
    config = build / "config"
    crds = crd_manifests(config, spec, webhook_url, ca_bundle)
    hooks = webhook_manifests(config, spec, webhook_url, ca_bundle)
    configuration = manager_configuration(spec, {"webhook": webhook_port, "health": health_port}, cert_dir)
    config_file = directory / "configuration.yaml"
    config_file.write_text(yaml.safe_dump(configuration, sort_keys=False))
    (directory / "crds.yaml").write_text(yaml.safe_dump_all(crds, sort_keys=False))
    (directory / "webhooks.yaml").write_text(yaml.safe_dump_all(hooks, sort_keys=False))
    if spec.metrics_cert_dir is not None:
        # The mount point, on the host: what of it the bed makes, `down` removes.
        made = make_dirs(Path(spec.metrics_cert_dir))
        state.host_dirs += [str(path) for path in made if str(path) not in state.host_dirs]
        handle._save(state)
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": spec.namespace}}
    handle.kubectl(state, "apply", "-f", "-", input=yaml.safe_dump(namespace))
    # Server-side: Kueue's Workload CRD is larger than client-side apply's annotation allows.
    handle.kubectl(state, "apply", "--server-side", "--force-conflicts", "-f", str(directory / "crds.yaml"))
    # Served before the manager starts: it sets up its informers on them at once.
    crd_names = [crd["metadata"]["name"] for crd in crds]
    wait_established(handle, state, crd_names)
    command = manager_command(spec, build / "bin" / name, config_file, state.kubeconfig, cert_dir)
    handle._start(state, name, command)
    # The webhooks only once the manager answers: with failurePolicy Fail, a configuration that
    # points at nothing would refuse every object it hooks.
    handle._wait(
        state, name, lambda: _ready(health_port) and _webhook_answers(webhook_port, state.ca_file), timeout
    )
    handle.kubectl(
        state, "apply", "--server-side", "--force-conflicts", "-f", str(directory / "webhooks.yaml")
    )
    log(f"dev-cluster: {name} running ({time.monotonic() - started:.1f} s), webhooks at {webhook_url}, "
        f"log {Path(state.dir) / 'logs' / f'{name}.log'}")  # fmt: skip
    return RunningAddon(name, directory, webhook_url, Path(state.dir) / "logs" / f"{name}.log")


def make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``; returns the directories it made, parents first."""
    missing = [p for p in (path, *path.parents) if not p.exists()][::-1]
    path.mkdir(parents=True, exist_ok=True)
    return missing


def stop_addon(handle: Cluster, state: ClusterState, name: str) -> bool:
    """Stop the add-on's manager and remove its webhook configurations (which would otherwise
    refuse what they hook, their server gone) and the mount point the bed made for it; its CRDs
    and objects stay.  True if it was running."""
    directory = Path(state.dir) / "addons" / name
    hooks = directory / "webhooks.yaml"
    if hooks.exists():
        with contextlib.suppress(ClusterError):
            handle.kubectl(state, "delete", "--ignore-not-found", "-f", str(hooks))
    stopped = _stop_and_forget(handle, state, [name])
    spec = ADDONS.get(name)
    if spec is not None and spec.metrics_cert_dir is not None:
        # Its mount namespace ended with it: the mount point is an empty directory again. What
        # the bed made of its path goes, deepest first (one that holds something stays).
        made = [d for d in state.host_dirs if Path(spec.metrics_cert_dir).is_relative_to(d)]
        for mount_dir in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(mount_dir)
            state.host_dirs.remove(mount_dir)
        handle._save(state)
    return stopped


def _stop_and_forget(handle: Cluster, state: ClusterState, names: list[str]) -> bool:
    """Stop the named processes and drop them from the bed's state; True if any was running."""
    stopped = bool(_stop(state, names))
    for name in names:
        state.pids.pop(name, None)
        (state.starts or {}).pop(name, None)
    handle._save(state)
    return stopped


# ----------------------------------------------------------------------------- KEDA


KEDA_NAMESPACE = "keda"
"""The namespace KEDA's release installs into (the operator's ``POD_NAMESPACE``)."""
EXTERNAL_METRICS_API = "v1beta1.external.metrics.k8s.io"
"""The APIService KEDA's metrics server serves, through which the HPA reads a trigger's value."""
KEDA_PROCESSES = ("keda-operator", "keda-adapter")
"""The bed's process names (``state.json``, ``logs/<name>.log``) and KEDA's binaries."""


def keda_crds(config: Path) -> list[dict[str, Any]]:
    """KEDA's CRDs as ``config/crd``'s kustomization makes them: its JSON patches (bounds on the
    HPA's stabilization windows) applied to the CRD each one targets."""
    directory = config / "crd"
    kustomization = _kustomization(directory)
    crds = [
        doc for resource in kustomization.get("resources", []) for doc in _documents(directory / resource)
    ]
    by_name = {crd["metadata"]["name"]: crd for crd in crds}
    for entry in kustomization.get("patches") or []:
        target = by_name.get((entry.get("target") or {}).get("name", ""))
        if target is not None and "path" in entry:
            _json_patch(target, yaml.safe_load((directory / entry["path"]).read_text()))
    return crds


def keda_metrics_api_objects(config: Path, port: int, ca_bundle: str) -> list[dict[str, Any]]:
    """KEDA's external-metrics APIService (``config/metrics-server/api_service.yaml``) served by the
    metrics server on this host: its Service is an ExternalName one (``localhost``), which the API
    server's aggregator dials at the APIService's port, verifying the bed CA's certificate for
    ``<service>.<namespace>.svc``.  (A selector-less Service with manual endpoints, the usual
    trick, cannot point at loopback: the API server refuses loopback endpoint addresses.)"""
    api_services = [
        doc
        for doc in _documents(config / "metrics-server" / "api_service.yaml")
        if doc.get("kind") == "APIService"
    ]
    if len(api_services) != 1:
        raise ClusterError(f"{config}/metrics-server/api_service.yaml: expected one APIService")
    api_service = copy.deepcopy(api_services[0])
    spec = api_service["spec"]
    reference = spec["service"]
    spec["service"] = {"name": reference["name"], "namespace": reference["namespace"], "port": port}
    spec["caBundle"] = ca_bundle
    spec.pop("insecureSkipTLSVerify", None)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": reference["name"], "namespace": reference["namespace"]},
        "spec": {
            "type": "ExternalName",
            "externalName": "localhost",
            "ports": [{"name": "https", "port": port}],
        },
    }
    return [service, api_service]


def keda_service_names(config: Path) -> list[str]:
    """The in-cluster names KEDA's certificate must carry: the metrics server's Service (the
    aggregator checks ``<name>.<namespace>.svc``)."""
    reference = _documents(config / "metrics-server" / "api_service.yaml")[0]["spec"]["service"]
    return [f"{reference['name']}.{reference['namespace']}.svc"]


def keda_commands(
    binaries: Path, cert_dir: Path, ca_dir: Path, kubeconfig: Path, ports: dict[str, int]
) -> dict[str, list[str]]:
    """The command lines of KEDA's operator and metrics server (pure), both logged in with the
    bed's admin kubeconfig and listening on loopback only.  Certificate rotation is off: the
    operator's own would issue certificates for in-cluster Service names and patch them into the
    APIService; ``cert_dir`` holds the bed CA's instead (``ca.crt``, ``tls.crt``, ``tls.key``),
    which both also use for their mutual TLS over gRPC (the metrics server asks the operator for a
    trigger's value at ``ports['grpc']``)."""
    # Out of a pod no service-account files say the namespace: KEDA's cluster-scoped objects'
    # Secrets (ClusterTriggerAuthentication) are read in its own, named here.
    env = ["env", f"KUBECONFIG={kubeconfig}", f"POD_NAMESPACE={KEDA_NAMESPACE}", "WATCH_NAMESPACE=",
           f"KEDA_CLUSTER_OBJECT_NAMESPACE={KEDA_NAMESPACE}"]  # fmt: skip
    logging = ["--zap-log-level=info", "--zap-encoder=console"]
    operator = [
        *env,
        str(binaries / "keda-operator"),
        "--leader-elect=false",
        "--enable-cert-rotation=false",
        f"--cert-dir={cert_dir}",
        f"--ca-dir={ca_dir}",  # the CAs its scalers trust beside the system's: not the host's /custom/ca
        f"--metrics-service-bind-address=127.0.0.1:{ports['grpc']}",
        f"--health-probe-bind-address=127.0.0.1:{ports['health']}",
        "--metrics-bind-address=0",
        *logging,
    ]
    adapter = [
        *env,
        str(binaries / "keda-adapter"),
        "--bind-address=127.0.0.1",
        f"--secure-port={ports['api']}",
        f"--cert-dir={cert_dir}",
        f"--tls-cert-file={cert_dir / 'tls.crt'}",
        f"--tls-private-key-file={cert_dir / 'tls.key'}",
        # Out of cluster: who may call it (the front-proxy CA and the request headers, from
        # kube-system/extension-apiserver-authentication) and what they may do (SubjectAccessReviews)
        # are asked of the API server with this kubeconfig, as is discovery.
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--lister-kubeconfig={kubeconfig}",
        f"--metrics-service-address=127.0.0.1:{ports['grpc']}",
        f"--port={ports['metrics']}",  # its own /metrics (plain HTTP; default 8080)
        *logging,
    ]
    return {"keda-operator": operator, "keda-adapter": adapter}


def _api_service_available(handle: Cluster, state: ClusterState) -> bool:
    try:
        found = handle.api_get(state, f"/apis/apiregistration.k8s.io/v1/apiservices/{EXTERNAL_METRICS_API}")
    except (OSError, urllib.error.URLError, ValueError):
        return False
    conditions = (found.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Available" and c.get("status") == "True" for c in conditions)


@dataclass(frozen=True)
class RunningKeda:
    directory: Path
    """``<bed>/addons/keda``: certificates, the manifests as applied."""
    logs: dict[str, Path]
    """Per process (:data:`KEDA_PROCESSES`), its log."""


def wait_established(handle: Cluster, state: ClusterState, names: list[str], timeout: float = 60.0) -> None:
    """Until every CustomResourceDefinition named is Established.  Not ``kubectl wait``: it fails at
    once on a CRD whose status has no conditions yet (just applied, on a loaded API server)."""
    deadline = time.monotonic() + timeout
    pending = list(names)
    while True:
        pending = [name for name in pending if not _established(handle, state, name)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"CRDs not Established after {timeout:.0f} s: {', '.join(pending)}")
        time.sleep(0.2)


def _established(handle: Cluster, state: ClusterState, name: str) -> bool:
    try:
        crd = handle.api_get(state, f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    except OSError:  # not found yet, or the API server busy (URLError and HTTPError are OSErrors)
        return False
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def start_keda(
    handle: Cluster, state: ClusterState, timeout: float = 120.0, log: Callable[[str], None] = print
) -> RunningKeda:
    """Build (or find) KEDA, apply its CRDs, start its operator and its metrics server against the
    bed and register the metrics server as the external metrics API; returns once the API server
    reports that APIService Available (its aggregator reached the metrics server).  KEDA's
    admission webhooks (``cmd/webhooks``) are not run: they only validate ScaledObjects."""
    if any(name in state.pids and handle.running().get(name) for name in KEDA_PROCESSES):
        raise ClusterError("keda already runs on this bed")
    started = time.monotonic()
    build = addon_dir(KEDA)
    config = build / "config"
    directory = Path(state.dir) / "addons" / KEDA
    cert_dir, ca_dir = directory / "certs", directory / "ca"
    names = ",".join(f"DNS:{name}" for name in keda_service_names(config))
    san = f"IP:127.0.0.1,DNS:localhost,{names}"
    issue_certificate(Path(state.dir) / "pki", cert_dir, "tls", "/CN=keda", san=san, key=EC_KEY)
    for target in (cert_dir, ca_dir):
        target.mkdir(parents=True, exist_ok=True)
        (target / "ca.crt").write_bytes(state.ca_file.read_bytes())
    ca_bundle = base64.b64encode(state.ca_file.read_bytes()).decode()
    grpc, health, api, metrics = free_ports(4)
    ports = {"grpc": grpc, "health": health, "api": api, "metrics": metrics}
    crds = keda_crds(config)
    (directory / "crds.yaml").write_text(yaml.safe_dump_all(crds, sort_keys=False))
    api_objects = keda_metrics_api_objects(config, api, ca_bundle)
    (directory / "metrics-api.yaml").write_text(yaml.safe_dump_all(api_objects, sort_keys=False))
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KEDA_NAMESPACE}}
    handle.kubectl(state, "apply", "-f", "-", input=yaml.safe_dump(namespace))
    handle.kubectl(state, "apply", "--server-side", "--force-conflicts", "-f", str(directory / "crds.yaml"))
    crd_names = [crd["metadata"]["name"] for crd in crds]
    wait_established(handle, state, crd_names)
    commands = keda_commands(build / "bin", cert_dir, ca_dir, state.kubeconfig, ports)
    handle._start(state, "keda-operator", commands["keda-operator"])
    handle._wait(state, "keda-operator", lambda: _ready(health), timeout)
    handle._start(state, "keda-adapter", commands["keda-adapter"])
    handle._wait(state, "keda-adapter", lambda: _webhook_answers(api, state.ca_file), timeout)
    handle.kubectl(state, "apply", "-f", str(directory / "metrics-api.yaml"))
    handle._wait(state, "keda-adapter", lambda: _api_service_available(handle, state), timeout)
    logs = {name: Path(state.dir) / "logs" / f"{name}.log" for name in KEDA_PROCESSES}
    log(f"dev-cluster: keda running ({time.monotonic() - started:.1f} s), {EXTERNAL_METRICS_API} served "
        f"at https://127.0.0.1:{api}, logs {', '.join(str(p) for p in logs.values())}")  # fmt: skip
    return RunningKeda(directory, logs)


def stop_keda(handle: Cluster, state: ClusterState) -> bool:
    """Stop KEDA's processes and withdraw the external metrics APIService (which would otherwise
    leave discovery of its group failing); its CRDs and objects stay.  True if it was running."""
    with contextlib.suppress(ClusterError):
        handle.kubectl(state, "delete", "--ignore-not-found", f"apiservice/{EXTERNAL_METRICS_API}")
    return _stop_and_forget(handle, state, list(KEDA_PROCESSES))


# ----------------------------------------------------------------------------- Kueue's queues


CPU_FLAVOR = "default"
"""The flavour of CPU and memory: any node."""


def flavor_name(gpu_type: str) -> str:
    """The bed's ResourceFlavor of a GPU type (``h100``, ``rtx-pro-6000``)."""
    return gpu_type.lower()


def kueue_queue_objects(
    groups: list[NodeGroup], cluster_queue: str = "mixrl", gpu_quota: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """ResourceFlavors for the fleet's GPU types and a ClusterQueue ``cluster_queue`` admitting
    any namespace's LocalQueues: per GPU flavour a quota of ``gpu_quota[type]`` GPUs (default: the
    fleet's GPUs of that type), CPU and memory in one resource group of their own (the fleet's)."""
    gpus: dict[str, int] = {}
    cpu = memory_gi = 0
    for group in groups:
        cpu += group.nodes * int(group.cpu)
        memory_gi += group.nodes * int(group.memory.removesuffix("Gi"))
        if group.gpu_type != "cpu":
            gpus[group.gpu_type] = gpus.get(group.gpu_type, 0) + group.nodes * group.gpus_per_node
    quota = {**gpus, **(gpu_quota or {})}
    flavors: list[dict[str, Any]] = [
        {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": CPU_FLAVOR}, "spec": {}}
    ]
    for gpu_type in quota:
        flavors.append(
            {
                "apiVersion": KUEUE_API,
                "kind": "ResourceFlavor",
                "metadata": {"name": flavor_name(gpu_type)},
                "spec": {
                    "nodeLabels": {GPU_PRODUCT_LABEL: GPU_TABLE[gpu_type].gfd_products[0]},
                    "nodeTaints": [GPU_TAINT],
                },
            }
        )
    queue = {
        "apiVersion": KUEUE_API,
        "kind": "ClusterQueue",
        "metadata": {"name": cluster_queue},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": [GPU_RESOURCE],
                    "flavors": [
                        {
                            "name": flavor_name(gpu_type),
                            "resources": [{"name": GPU_RESOURCE, "nominalQuota": count}],
                        }
                        for gpu_type, count in quota.items()
                    ],
                },
                {
                    "coveredResources": ["cpu", "memory"],
                    "flavors": [
                        {
                            "name": CPU_FLAVOR,
                            "resources": [
                                {"name": "cpu", "nominalQuota": cpu},
                                {"name": "memory", "nominalQuota": f"{memory_gi}Gi"},
                            ],
                        }
                    ],
                },
            ],
        },
    }
    return [*flavors, queue]


def local_queue(namespace: str, name: str, cluster_queue: str) -> dict[str, Any]:
    return {
        "apiVersion": KUEUE_API,
        "kind": "LocalQueue",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterQueue": cluster_queue},
    }
