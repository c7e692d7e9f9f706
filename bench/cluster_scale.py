"""The operator at scale on the real control plane: 1,000 KWOK GPU nodes of mixed types, 50 RLRuns of
8 pools each (examples/rlrun-mixed.yaml, renamed) applied at once.

    .venv/bin/python bench/cluster_scale.py                     # 1,000 nodes, 50 runs (about 10-20 min on 2 cores)
    .venv/bin/python bench/cluster_scale.py --nodes 100 --runs 5   # a smoke check

Two passes on the same control plane, one after the other:
- **direct** (the baseline): the objects the operator would create for those runs — built by the
  operator's own pure builders from the same documents (``run_objects``, and each pool's Deployment
  and Service from ``pool_children`` in place of its SamplerPool), without owner references — in one
  ``kubectl apply --server-side``; measured: apply → every pool's Deployment Ready. Then deleted,
  and the next pass waits until their pods are gone.
- **operator**: the RLRuns applied, with the chart installed by Helm and the chart's operator as a
  local process logged in with its ServiceAccount's token (so RBAC applies); measured: apply →
  every SamplerPool Ready (all its replicas Running on their GPU nodes), the operator's API
  requests (from the API server's audit log) per run while converging and during one idle resync
  period once everything is Ready (writes there must be 0), and its resident memory.
Both: p50 / p99 / max over the pools; the ratio operator ÷ direct is the operator's own cost (the
target: p99 within 1.2×).  Where the operator's time goes, from the audit log and /proc: when
``kubectl apply`` returned in each pass, when each SamplerPool was created and each pool
Deployment first written, the API server's answer times, the requests by verb and kind, and the
operator's CPU seconds (``--keep-audit PATH`` keeps the log to study it further). Recorded with the command in docs/benchmarks.md; plot
docs/img/cluster-scale.png (both passes' Ready curves, and the operator's requests).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from mixrl.devcluster.cluster import Cluster, ClusterState, kubeconfig
from mixrl.devcluster.kwok_fleet import NodeGroup

ROOT = Path(__file__).resolve().parents[1]
RELEASE, RELEASE_NS, NAMESPACE, DIRECT_NS = "mixrl", "mixrl-system", "bench", "direct"
# The mix: enough H200s for every run's trainer (4 x 8 GPUs) beside the H200 pools.
SHARES = {"H200": 0.34, "H100": 0.16, "B200": 0.16, "B300": 0.1, "A100": 0.12, "RTX-PRO-6000": 0.12}


def fleet(nodes: int) -> list[NodeGroup]:
    groups = [NodeGroup(gpu, max(1, round(nodes * share))) for gpu, share in SHARES.items()]
    return [*groups, NodeGroup("cpu", max(2, nodes // 50), 0)]


def kubectl(state: ClusterState, *args: str, input: str | None = None) -> str:
    done = subprocess.run(
        [str(Path(state.bin) / "kubectl"), f"--kubeconfig={state.kubeconfig}", *args],
        input=input, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"cluster_scale: kubectl {' '.join(args[:2])} failed: {done.stderr.strip()}")
    return done.stdout


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def breakdown(events: list[dict[str, Any]]) -> dict[str, int]:
    """Requests by ``verb resource[/subresource]``, most first."""

    def key(event: dict[str, Any]) -> str:
        ref = event.get("objectRef", {})
        sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
        return f"{event.get('verb')} {ref.get('resource', '?')}{sub}"

    return dict(Counter(map(key, events)).most_common())


def first_writes(events: list[dict[str, Any]], resource: str, since: float, names: set[str]) -> list[float]:
    """Seconds after the wall-clock time ``since`` at which each ``resource`` object named in
    ``names`` was first written (created, or applied), sorted: where the operator's time goes
    before the cluster's."""
    first: dict[str, float] = {}
    for event in events:
        ref = event.get("objectRef", {})
        named = ref.get("name") in names and not ref.get("subresource")
        if named and ref.get("resource") == resource and is_write(event):
            first.setdefault(ref["name"], stamp(event["requestReceivedTimestamp"]) - since)
    return sorted(first.values())


def stamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def answer_times(events: list[dict[str, Any]]) -> list[float]:
    """Seconds the API server took to answer each request (received -> response complete), sorted:
    its queueing (priority and fairness) and work, apart from the operator's."""
    return sorted(
        stamp(e["stageTimestamp"]) - stamp(e["requestReceivedTimestamp"])
        for e in events
        if e.get("stage") == "ResponseComplete" and e.get("verb") != "watch"
    )


class Audit:
    """The API server's audit events of one user, read as the log grows: each call parses only the
    lines written since the last one, and only those that name the user.  (Parsing the whole log
    every second, as this benchmark first did, cost the operator pass alone 0.18 s of CPU per
    sample by the end of a 400-node, 20-run bench (a 5 MB log), more at full scale — taken from the
    control plane it measures.)"""

    def __init__(self, path: Path, user: str):
        self.path, self.user, self.offset = path, user, 0
        self.events: list[dict[str, Any]] = []

    def __call__(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with self.path.open("rb") as log:
                log.seek(self.offset)
                chunk = log.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self.offset += len(complete)
            needle = self.user.encode()
            for line in complete.splitlines():
                if needle in line:
                    event = json.loads(line)
                    if event.get("user", {}).get("username") == self.user:
                        self.events.append(event)
        return self.events


def is_write(event: dict[str, Any]) -> bool:
    return (
        event.get("verb") in ("create", "update", "patch", "delete")
        and event.get("objectRef", {}).get("apiGroup") != "kopf.dev"
    )


def direct_objects(docs: list[dict[str, Any]], chart_args: list[str], namespace: str) -> list[dict[str, Any]]:
    """What the operator would create for ``docs``, from its own builders with the options its chart
    arguments give, in ``namespace``, with no owner (the garbage collector would delete children of
    an owner that does not exist)."""
    from mixrl.api.loader import parse_document
    from mixrl.api.models import RLRun
    from mixrl.api.resolve import resolve
    from mixrl.operator.builders.objects import BuildOptions, Owner
    from mixrl.operator.builders.pools import pool_children
    from mixrl.operator.builders.resources import run_objects, seed_replicas
    from mixrl.operator.main import images_of, parse_args

    args = parse_args(chart_args)
    options = BuildOptions(images=images_of(args), drain_seconds=args.drain_seconds)
    out: list[dict[str, Any]] = []
    for doc in docs:
        run = parse_document({**doc, "metadata": {**doc["metadata"], "namespace": namespace}})
        assert isinstance(run, RLRun)
        resolved = resolve(run)
        owner = Owner("mixrl.dev/v1alpha1", "RLRun", resolved.name, "direct")
        objects = [o for o in run_objects(resolved, owner, options) if o["kind"] != "SamplerPool"]
        for pool in resolved.pools:
            objects += pool_children(resolved, pool, seed_replicas(pool), owner, options)
        for obj in objects:
            obj["metadata"].pop("ownerReferences", None)
            obj["metadata"]["namespace"] = namespace
        out += objects
    return out


class ReadyWatch:
    """When each object of one kind in one namespace first had all its replicas ready, from a
    ``kubectl get --watch`` started before the apply: every status change is seen as it happens,
    at no cost of repeated lists to the control plane, and the same way in both passes."""

    def __init__(self, state: ClusterState, resource: str, namespace: str, t0: float):
        self.ready_at: dict[str, float] = {}
        self.t0 = t0
        columns = "NAME:.metadata.name,WANT:.spec.replicas,READY:.status.readyReplicas"
        self.process = subprocess.Popen(
            [str(Path(state.bin) / "kubectl"), f"--kubeconfig={state.kubeconfig}", "get", resource,
             "-n", namespace, "--watch", "--no-headers", "-o", f"custom-columns={columns}"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            name, want, ready = [*line.split(), "", "", ""][:3]
            if want.isdigit() and int(want) > 0 and ready == want:
                self.ready_at.setdefault(name, time.monotonic() - self.t0)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def wait_ready(
    watch: ReadyWatch, names: set[str], total: int, timeout: float, label: str, sample: Any = None,
) -> dict[str, float]:  # fmt: skip
    """Name -> seconds after the watch's ``t0`` at which it had all its replicas ready, once
    ``total`` of ``names`` are; progress with rate and ETA every 10 s."""
    last_print = 0.0

    def ready() -> dict[str, float]:
        return {k: v for k, v in dict(watch.ready_at).items() if k in names}

    while len(ready()) < total:
        now = time.monotonic() - watch.t0
        if now > timeout:
            sys.exit(f"cluster_scale: {label}: only {len(ready())}/{total} pools Ready after {timeout:.0f} s")
        done = len(ready())
        if sample is not None:
            sample(now, done)
        if now - last_print > 10:
            rate = done / now if now else 0.0
            eta = (total - done) / rate if rate else float("nan")
            print(f"  {label}: {done}/{total} pools Ready, {rate:.2f} pools/s, eta {eta:.0f} s", flush=True)
            last_print = now
        time.sleep(1)
    return ready()


def quantiles(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {
        "p50_s": statistics.median(times),
        "p99_s": times[min(len(times) - 1, round(0.99 * (len(times) - 1)))],
        "max_s": times[-1],
    }


def runs(count: int) -> list[dict[str, Any]]:
    template = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())
    template["spec"]["autoscaling"] = {
        "engine": "none"
    }  # the operator's reconcile path, not the autoscaler's
    out = []
    for index in range(count):
        doc = json.loads(json.dumps(template))
        doc["metadata"] = {"name": f"run-{index:02d}", "namespace": NAMESPACE}
        out.append(doc)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000, help="simulated GPU nodes (default 1000)")
    parser.add_argument("--runs", type=int, default=50, help="RLRuns of 8 pools applied at once (default 50)")
    parser.add_argument("--resync-seconds", type=float, default=60.0, help="the operator's resync period")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "cluster-scale.png")
    parser.add_argument("--keep-audit", type=Path, help="copy the API server's audit log here (to study it)")
    args = parser.parse_args(argv)
    if args.nodes < 10 or args.runs < 1:
        parser.error("--nodes: at least 10; --runs: at least 1")

    # A TERM (a CI timeout, kill) still runs the `finally` below, which stops the control plane.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="mixrl-cluster-scale-"))
    cluster = Cluster(work / "cluster")
    groups = fleet(args.nodes)
    print(f"cluster_scale: starting the control plane with {sum(g.nodes for g in groups)} nodes", flush=True)
    started = time.monotonic()
    # Each run claims the weights volume, one volume per trainer node (4) and the buffer's, in
    # each pass (a deleted claim's volume is not bound again).
    state = cluster.up(groups, volumes=args.runs * 12 + 4, timeout=300)
    print(f"cluster_scale: nodes Ready in {time.monotonic() - started:.1f} s", flush=True)
    operator: subprocess.Popen[bytes] | None = None
    try:
        env = {**os.environ, "KUBECONFIG": str(state.kubeconfig), "HOME": str(work)}
        subprocess.run(
            [str(Path(state.bin) / "helm"), "install", RELEASE, str(ROOT / "charts" / "mixrl"), "-n", RELEASE_NS,
             "--create-namespace", "--wait", "--timeout", "120s", "--set", "watch.allNamespaces=true"],
            env=env, check=True, capture_output=True,
        )  # fmt: skip
        kubectl(state, "create", "namespace", NAMESPACE)
        token = kubectl(state, "create", "token", RELEASE, "-n", RELEASE_NS, "--duration=6h").strip()
        (work / "operator.kubeconfig").write_text(
            yaml.safe_dump(kubeconfig(state.server, state.ca_file, token, "operator"))
        )
        deployment = json.loads(
            kubectl(state, "get", f"deployment/{RELEASE}", "-n", RELEASE_NS, "-o", "json")
        )
        chart_args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        chart_args = [
            a.replace("$(POD_NAME)", "mixrl-bench-0") for a in chart_args if not a.startswith("--liveness")
        ]
        user = f"system:serviceaccount:{RELEASE_NS}:{RELEASE}"
        audit = Audit(state.audit_log, user)
        docs = runs(args.runs)
        pools_total = sum(len(d["spec"]["samplerPools"]) for d in docs)

        # The baseline: the same objects applied directly, no operator running yet.
        kubectl(state, "create", "namespace", DIRECT_NS)
        objects = direct_objects(docs, chart_args, DIRECT_NS)
        pool_names = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"} & {
            f"{d['metadata']['name']}-{pool['name']}" for d in docs for pool in d["spec"]["samplerPools"]
        }
        print(
            f"cluster_scale: direct pass: {len(objects)} objects, {len(pool_names)} pool Deployments",
            flush=True,
        )
        t0 = time.monotonic()
        watch = ReadyWatch(state, "deployments", DIRECT_NS, t0)
        kubectl(state, "apply", "--server-side", "--field-manager=cluster-scale", "-f", "-",
                input=yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}))  # fmt: skip
        direct_applied_s = time.monotonic() - t0
        direct_at = wait_ready(watch, pool_names, len(pool_names), args.timeout, "direct")
        watch.stop()
        gone = time.monotonic()
        kubectl(state, "delete", "namespace", DIRECT_NS, "--timeout=900s")
        print(f"cluster_scale: direct pass deleted in {time.monotonic() - gone:.0f} s", flush=True)

        with (work / "operator.log").open("wb") as log:
            operator = subprocess.Popen(
                [sys.executable, "-m", "mixrl.cli", "operator", *chart_args, f"--resync-seconds={args.resync_seconds}"],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "KUBECONFIG": str(work / "operator.kubeconfig")},
            )  # fmt: skip
        # The burst comes once the operator watches what it reconciles (its first listings done), as
        # on a cluster whose operator was up before the runs came: runs in kopf's first listing
        # would be read as possibly older objects (a fixed sleep, as before, does not make sure).
        watched = {"rlruns", "samplerpools", "deployments", "services"}
        started = time.monotonic()
        while not watched <= {
            e.get("objectRef", {}).get("resource") for e in audit() if e.get("verb") == "watch"
        }:
            if time.monotonic() - started > 120:
                sys.exit(
                    "cluster_scale: the operator did not watch its kinds within 120 s (see operator.log)"
                )
            time.sleep(0.5)
        print(f"cluster_scale: the operator watches after {time.monotonic() - started:.1f} s", flush=True)
        time.sleep(1)
        baseline = len(audit())
        cpu_before = cpu_seconds(operator.pid)
        t0, t0_wall = time.monotonic(), time.time()
        # When each pool's Deployment had all its pods ready (the cluster's part), beside when its
        # SamplerPool's status said so (the operator's status write after it).
        pools_watch = ReadyWatch(state, "samplerpools", NAMESPACE, t0)
        deployments_watch = ReadyWatch(state, "deployments", NAMESPACE, t0)
        # Applied as the baseline's objects are: server-side, one request each.
        kubectl(state, "apply", "--server-side", "--field-manager=cluster-scale", "-f", "-",
                input=yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": docs}))  # fmt: skip
        runs_applied_s = time.monotonic() - t0
        peak_rss = 0.0
        timeline: list[tuple[float, int, int]] = []

        def sample(now: float, ready: int) -> None:
            nonlocal peak_rss
            assert operator is not None
            peak_rss = max(peak_rss, rss_mib(operator.pid))
            timeline.append((now, ready, len(audit()) - baseline))

        ready_at = wait_ready(pools_watch, pool_names, pools_total, args.timeout, "operator", sample)
        deployment_ready_at = dict(deployments_watch.ready_at)
        pools_watch.stop()
        deployments_watch.stop()
        converging = audit()[baseline:]
        converge_requests = len(converging)
        converge_cpu = cpu_seconds(operator.pid) - cpu_before
        times = sorted(ready_at.values())
        # Pool names are the Deployments' names (``<run>-<pool>``) in both namespaces.
        lags = [ready_at[name] - at for name, at in deployment_ready_at.items() if name in ready_at]
        # The runs' status follows their pools' readiness a moment later: wait until the operator
        # has written nothing for 15 s, then count one idle resync period.
        quiet_since, writes = time.monotonic(), sum(map(is_write, audit()))
        while time.monotonic() - quiet_since < 15 and time.monotonic() - t0 < args.timeout:
            time.sleep(1)
            now_writes = sum(map(is_write, audit()))
            if now_writes != writes:
                quiet_since, writes = time.monotonic(), now_writes
        settled_s = quiet_since - t0
        idle_start = len(audit())
        time.sleep(args.resync_seconds)
        idle = audit()[idle_start:]
        idle_rss = rss_mib(operator.pid)
        ours, direct = quantiles(times), quantiles(list(direct_at.values()))
        result = {
            "nodes": sum(g.nodes for g in groups),
            "runs": args.runs,
            "pools": pools_total,
            **{f"ready_{k}": v for k, v in ours.items()},
            **{f"direct_ready_{k}": v for k, v in direct.items()},
            **{
                f"operator_deployment_ready_{k}": v
                for k, v in quantiles(list(deployment_ready_at.values()) or [float("nan")]).items()
            },
            "status_lag_after_deployment_ready_p50_p99_s": [
                quantiles(lags)[q] if lags else float("nan") for q in ("p50_s", "p99_s")
            ],
            "p99_operator_over_direct": ours["p99_s"] / direct["p99_s"],
            "direct_kubectl_apply_s": direct_applied_s,
            "runs_kubectl_apply_s": runs_applied_s,
            **{
                f"pool_created_{k}": v
                for k, v in quantiles(first_writes(converging, "samplerpools", t0_wall, pool_names)).items()
            },
            **{
                f"deployment_written_{k}": v
                for k, v in quantiles(first_writes(converging, "deployments", t0_wall, pool_names)).items()
            },
            "status_settled_s": settled_s,
            "requests_while_converging": converge_requests,
            "requests_per_run": converge_requests / args.runs,
            "requests_by_kind": breakdown(converging),
            **{f"answer_{k}": v for k, v in quantiles(answer_times(converging)).items()},
            "operator_cpu_s_while_converging": converge_cpu,
            "idle_resync_requests": len(
                [e for e in idle if e.get("objectRef", {}).get("apiGroup") != "kopf.dev"]
            ),
            "idle_resync_writes": sum(map(is_write, idle)),
            "operator_peak_rss_mib": peak_rss,
            "operator_idle_rss_mib": idle_rss,
        }
        print(json.dumps(result, indent=2))
        plot(timeline, times, sorted(direct_at.values()), result, args.plot)
        return 0
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(20)
        if args.keep_audit is not None and state.audit_log.exists():
            shutil.copyfile(state.audit_log, args.keep_audit)
        cluster.down(log=lambda _: None)


def plot(
    timeline: list[tuple[float, int, int]],
    times: list[float],
    direct: list[float],
    result: dict[str, Any],
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(
        times, [i / len(times) for i in range(1, len(times) + 1)], drawstyle="steps-post", label="operator"
    )
    left.plot(
        direct, [i / len(direct) for i in range(1, len(direct) + 1)], drawstyle="steps-post",
        label=f"direct apply (p99 {result['direct_ready_p99_s']:.0f} s)",
    )  # fmt: skip
    left.set(xlabel="seconds after the apply", ylabel="share of pools Ready",
             title=f"{result['runs']} RLRuns x 8 pools on {result['nodes']} KWOK nodes")  # fmt: skip
    left.axvline(
        result["ready_p50_s"], ls="--", c="grey", label=f"operator p50 {result['ready_p50_s']:.0f} s"
    )
    left.axvline(result["ready_p99_s"], ls=":", c="k", label=f"operator p99 {result['ready_p99_s']:.0f} s")
    left.legend()
    right.plot([t for t, _, _ in timeline], [r for _, _, r in timeline])
    right.set(xlabel="seconds after the apply", ylabel="operator API requests (cumulative)",
              title=f"{result['requests_per_run']:.0f} requests per run; idle resync: "
              f"{result['idle_resync_requests']} requests, {result['idle_resync_writes']} writes")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"cluster_scale: plot written to {path}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
