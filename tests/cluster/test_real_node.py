"""The test bed's real node: pods really run (kubelet, containerd, runc, the CNI bridge), reach each
other through Services by name (kube-proxy, CoreDNS), reach the API server, answer ``kubectl logs``
and ``exec`` (the API server's kubelet client certificate), reach nothing off the machine, and
``down`` removes everything the node made."""

from __future__ import annotations

import json
import subprocess
import urllib.request
import uuid
from pathlib import Path

import pytest

from mixrl.devcluster import images, network, node
from mixrl.devcluster.cluster import ClusterError
from tests.cluster.conftest import Bed, wait_for
from tests.cluster.real_run import probe, probed

SHELL = images.SHELL_IMAGE


def namespace(bed: Bed) -> str:
    name = f"real-{uuid.uuid4().hex[:6]}"
    bed.kubectl("create", "namespace", name)
    return name


def pod(name: str, command: str, **spec: object) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": SHELL, "command": ["sh", "-c", command]}],
            **spec,
        },
    }


def phase(bed: Bed, ns: str, name: str) -> str:
    return bed.get("pod", name, "-n", ns).get("status", {}).get("phase", "")


def finished(bed: Bed, ns: str, name: str, timeout: float = 60) -> str:
    return wait_for(lambda: phase(bed, ns, name) if phase(bed, ns, name) in ("Succeeded", "Failed") else "",
                    timeout=timeout, what=f"pod {name} to finish")  # fmt: skip


def test_the_node_is_real_and_ready(real_bed: Bed) -> None:
    nodes = real_bed.get("nodes")["items"]
    assert [n["metadata"]["name"] for n in nodes] == ["mixrl-node-0"]
    (item,) = nodes
    assert item["metadata"]["labels"][node.REAL_NODE_LABEL] == "true"
    info = item["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.37.2" and info["containerRuntimeVersion"].startswith("containerd://")
    addresses = {a["type"]: a["address"] for a in item["status"]["addresses"]}
    assert addresses["InternalIP"] == network.node_addresses(1)[0].ip


def test_a_pod_runs_and_its_log_is_read_through_the_kubelet(real_bed: Bed) -> None:
    ns = namespace(real_bed)
    real_bed.apply(pod("hello", "echo hello from $(hostname) as $(id -u)"), namespace=ns)
    assert finished(real_bed, ns, "hello") == "Succeeded"
    assert real_bed.kubectl("logs", "-n", ns, "hello").stdout.strip() == "hello from hello as 0"


def test_services_resolve_by_name_and_exec_reaches_the_container(real_bed: Bed) -> None:
    ns = namespace(real_bed)
    server = pod("web", "mkdir -p /tmp/www && echo served-by-web > /tmp/www/index.html && httpd -f -p 8080 -h /tmp/www",
                 restartPolicy="Always")  # fmt: skip
    server["spec"]["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": 8080}, "periodSeconds": 1}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    real_bed.apply(server, namespace=ns)
    real_bed.apply(service, namespace=ns)
    real_bed.kubectl("wait", "-n", ns, "--for=condition=Ready", "pod/web", "--timeout=60s")
    exec_out = real_bed.kubectl("exec", "-n", ns, "web", "--", "cat", "/tmp/www/index.html").stdout
    assert exec_out.strip() == "served-by-web"
    # Through the Service's cluster IP (kube-proxy) by its DNS name (CoreDNS), from another pod.
    # (busybox's nc: its static wget crashes resolving through glibc's NSS.)
    request = f"printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 5 web.{ns}.svc.cluster.local 80"
    client = pod("client", request)
    real_bed.apply(client, namespace=ns)
    assert finished(real_bed, ns, "client") == "Succeeded", real_bed.kubectl(
        "logs", "-n", ns, "client"
    ).stdout
    response = real_bed.kubectl("logs", "-n", ns, "client").stdout
    assert response.startswith("HTTP/1.1 200") and response.strip().endswith("served-by-web")


def test_pods_reach_the_api_server_through_the_kubernetes_service(real_bed: Bed) -> None:
    ns = namespace(real_bed)
    real_bed.apply(
        pod("api", "nc -w 5 kubernetes.default.svc.cluster.local 443 </dev/null && echo reached"),
        namespace=ns,
    )
    assert finished(real_bed, ns, "api") == "Succeeded", real_bed.kubectl("logs", "-n", ns, "api").stdout
    assert real_bed.kubectl("logs", "-n", ns, "api").stdout.strip() == "reached"


def test_nothing_leaves_the_machine(real_bed: Bed) -> None:
    """A pod's packets to an address off the machine are dropped (the bed's forward rule), and names
    outside the cluster do not resolve (CoreDNS has no upstream)."""
    ns = namespace(real_bed)
    # One stream: the runtime logs stdout and stderr through separate pipes, so their order interleaves.
    probe = ("exec 2>&1; nc -w 3 192.0.2.1 80 </dev/null && echo LEFT; nc -w 3 1.1.1.1 80 </dev/null && echo LEFT; "
             "nslookup example.com >/dev/null 2>&1 && echo RESOLVED; echo done")  # fmt: skip
    real_bed.apply(pod("out", probe), namespace=ns)
    assert finished(real_bed, ns, "out") == "Succeeded"
    words = real_bed.kubectl("logs", "-n", ns, "out").stdout.split()
    assert words[-1] == "done" and "LEFT" not in words and "RESOLVED" not in words, words
    rules = subprocess.run(
        ["nft", "list", "table", "inet", network.NFT_TABLE], capture_output=True, text=True
    )
    assert rules.returncode == 0 and "drop" in rules.stdout


def test_network_policies_are_enforced(real_bed: Bed) -> None:
    """The bed's enforcer (mixrl.devcluster.netpol): a policy on ``web`` lets only ``friend`` pods
    of its namespace in, on the named port ``http``, by pod IP (bridged) and through the Service
    (routed by kube-proxy); another port, another pod and the same labels in another namespace are
    refused, while a pod no policy selects stays open to all; an egress policy cuts a pod off; the
    bed's host still reaches the isolated pod."""
    ns, other = namespace(real_bed), namespace(real_bed)
    serve = ("mkdir -p /tmp/www && echo served-by-web > /tmp/www/index.html && httpd -p 9090 -h /tmp/www && "
             "httpd -f -p 8080 -h /tmp/www")  # fmt: skip
    server = pod("web", serve, restartPolicy="Always")
    server["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": 8080}]
    server["spec"]["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": 8080}, "periodSeconds": 1}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
               "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}}  # fmt: skip
    policies = [
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "web-in"},
         "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"],
                  "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "friend"}}}],
                               "ports": [{"port": "http", "protocol": "TCP"}]}]}},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "guarded-in"},
         "spec": {"podSelector": {"matchLabels": {"app": "guarded"}}, "policyTypes": ["Ingress"], "ingress": []}},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "quiet-out"},
         "spec": {"podSelector": {"matchLabels": {"app": "quiet"}}, "policyTypes": ["Egress"], "egress": []}},
    ]  # fmt: skip
    plain = pod("plain", serve.replace("web", "plain"), restartPolicy="Always")  # no policy selects it
    plain["spec"]["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": 8080}, "periodSeconds": 1}
    for obj in (server, plain, service, *policies):
        real_bed.apply(obj, namespace=ns)
    for name in ("web", "plain"):
        real_bed.kubectl("wait", "-n", ns, "--for=condition=Ready", f"pod/{name}", "--timeout=60s")
    ip, open_ip = (real_bed.get("pod", name, "-n", ns)["status"]["podIP"] for name in ("web", "plain"))
    probes = {
        (ns, "friend"): probe("friend", [f"{ip}:8080", f"{ip}:9090", f"web.{ns}.svc.cluster.local:80"], {"app": "friend"}),
        (ns, "stranger"): probe("stranger", [f"{ip}:8080", f"web.{ns}.svc.cluster.local:80", f"{open_ip}:8080"],
                                {"app": "stranger"}),
        (other, "friend"): probe("friend", [f"{ip}:8080", f"web.{ns}.svc.cluster.local:80"], {"app": "friend"}),
        (ns, "quiet"): probe("quiet", [f"{open_ip}:8080"], {"app": "quiet"}),
        (ns, "guarded"): probe("guarded", [f"{open_ip}:8080", f"web.{ns}.svc.cluster.local:80"], {"app": "guarded"}),
    }  # fmt: skip
    expected = {
        (ns, "friend"): [f"{ip}:8080 open", f"{ip}:9090 blocked", f"web.{ns}.svc.cluster.local:80 open"],
        (ns, "stranger"): [
            f"{ip}:8080 blocked",
            f"web.{ns}.svc.cluster.local:80 blocked",
            f"{open_ip}:8080 open",
        ],
        (other, "friend"): [f"{ip}:8080 blocked", f"web.{ns}.svc.cluster.local:80 blocked"],
        (ns, "quiet"): [f"{open_ip}:8080 blocked"],
        # a pod that takes no connection still opens its own (the replies pass)
        (ns, "guarded"): [f"{open_ip}:8080 open", f"web.{ns}.svc.cluster.local:80 blocked"],
    }

    def enforced(ips: dict[tuple[str, str], str], rules: str) -> bool:
        # web's chain allows this namespace's friend, and quiet has its egress chain
        return (
            f"ingress of {ns}/web" in rules
            and ips[(ns, "friend")] in rules
            and f"egress of {ns}/quiet" in rules
        )

    assert probed(real_bed, probes, enforced) == expected
    with urllib.request.urlopen(f"http://{ip}:9090/index.html", timeout=5) as answer:  # the host: exempt
        assert answer.read().strip() == b"served-by-web"


def test_claims_bind_to_volumes_the_pods_write(real_bed: Bed) -> None:
    ns = namespace(real_bed)
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    writer = pod("writer", "echo kept > /data/file && cat /data/file",
                 securityContext={"runAsUser": 1000, "runAsGroup": 1000},
                 volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}])  # fmt: skip
    writer["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    real_bed.apply(claim, namespace=ns)
    real_bed.apply(writer, namespace=ns)
    assert finished(real_bed, ns, "writer") == "Succeeded", real_bed.kubectl(
        "logs", "-n", ns, "writer"
    ).stdout
    volume = real_bed.get("pvc", "data", "-n", ns)["spec"]["volumeName"]
    path = Path(real_bed.get("pv", volume)["spec"]["hostPath"]["path"])
    assert (path / "file").read_text() == "kept\n" and str(path).startswith(real_bed.state.dir)


@pytest.mark.ends_real_bed
def test_down_removes_everything_the_node_made(real_bed: Bed) -> None:
    """Last in the session (``ends_real_bed``): it ends the session's real-node bed."""
    ns = namespace(real_bed)
    real_bed.apply(pod("sleeper", "sleep 3600", restartPolicy="Always"), namespace=ns)
    real_bed.kubectl("wait", "-n", ns, "--for=condition=Ready", "pod/sleeper", "--timeout=60s")
    bed_dir = Path(real_bed.state.dir)
    real_bed.handle.down(log=lambda _: None)
    links = subprocess.run(["ip", "-j", "link"], capture_output=True, text=True).stdout
    assert not [link["ifname"] for link in json.loads(links) if link["ifname"].startswith("mixrl")]
    assert not list(network.NETNS_DIR.glob("mixrl-node-*"))
    assert not set(real_bed.state.netns_before or []) ^ {p.name for p in network.NETNS_DIR.glob("cni-*")}
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(bed_dir) not in mounts
    assert not list(Path("/sys/fs/cgroup").glob("*/mixrl-node-0"))
    table = subprocess.run(["nft", "list", "table", "inet", network.NFT_TABLE], capture_output=True)
    assert table.returncode != 0
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(bed_dir).encode() in _cmdline(p)]
    assert left == [], f"processes of the bed still running: {[_cmdline(p)[:120] for p in left]}"
    try:
        real_bed.handle.api_get(real_bed.state, "/readyz")
    except (OSError, ClusterError):
        pass
    else:
        raise AssertionError("the API server still answers after down")


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""
