"""`mixrl operator`: its flags (each bad one refused in one line naming it; images pinned; one peering
priority per replica), and as a process: kubeconfig login (--dev), peering, reconcile, clean stop
on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from mixrl.operator.builders.objects import Images
from mixrl.operator.install.cluster_policy import OPEN, Policy
from mixrl.operator.main import (
    DEV_PRIORITY,
    images_of,
    parse_args,
    peering_priority,
    policy_of,
    replica_priority,
)

from .emulator import ApiServer
from .support import DEPLOYMENTS, NAMESPACE, create, eventually, small_run

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: emulator, cluster: {server: "%s"}}]
users: [{name: dev, user: {token: dev-token}}]
contexts: [{name: emulator, context: {cluster: emulator, user: dev}}]
current-context: emulator
"""


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (
            ["--components-image", "ghcr.io/mixrl/mixrl-components"],
            "--components-image: ghcr.io/mixrl/mixrl-components has no tag",
        ),
        (["--sglang-image", "registry:5000/sglang"], "--sglang-image: registry:5000/sglang has no tag"),
        (
            ["--trainer-image", "ghcr.io/mixrl/mixrl-trainer-torch:latest"],
            "--trainer-image: ghcr.io/mixrl/mixrl-trainer-torch:latest uses :latest",
        ),
        (["--image-pull-secret", "Reg_Cred"], "--image-pull-secret: 'Reg_Cred' is not a DNS subdomain name"),
        (
            ["--weights-storage-class", "fast nfs"],
            "--weights-storage-class: 'fast nfs' is not a DNS subdomain name",
        ),
        (["--pod-monitor-label", "release"], "--pod-monitor-label: 'release': expected KEY=VALUE"),
        (["--pod-monitor-label", "release=a b"], "--pod-monitor-label: 'a b' is not a label value"),
        (
            ["--pod-monitor-label", "app.kubernetes.io/instance=x"],
            "--pod-monitor-label: app.kubernetes.io/instance is the operator's own label",
        ),
        (["--gpu-node-label", "H800:a=b"], "--gpu-node-label: unknown GPU type 'H800'"),
        (["--gpu-node-label", "H100=a=b"], "--gpu-node-label: 'H100=a=b': expected GPUTYPE:KEY=VALUE"),
        (
            ["--scheduler-name", "Mixrl_Packing"],
            "--scheduler-name: 'Mixrl_Packing' is not a DNS subdomain name",
        ),
        (["--standalone", "--replica-id", "pod-a"], "--replica-id: a standalone operator has no peers"),
        (["--resync-seconds", "-1"], "--resync-seconds: must be a number of seconds, 0 or more, got -1.0"),
        (["--resync-seconds", "nan"], "--resync-seconds: must be a number of seconds, 0 or more, got nan"),
        (["--standalone", "--priority", "3"], "--priority: a standalone operator has no peering"),
        (["--standalone", "--peering", "other"], "--peering: a standalone operator has no peering"),
        (
            ["--no-network-policies", "--scraper-namespace", "monitoring"],
            "--scraper-namespace: names who may scrape through the network policies, which",
        ),
        (
            ["--no-network-policies", "--scraper-pod-label", "app=prometheus"],
            "--scraper-pod-label: names who may scrape through the network policies, which",
        ),
        (
            ["--no-live-status", "--status-seconds", "5"],
            "--status-seconds: sets the live status, which --no-live-status turns off",
        ),
        (
            ["--no-live-status", "--status-write-seconds", "5"],
            "--status-write-seconds: sets the live status, which --no-live-status turns off",
        ),
        (
            ["--explain-placement", "--no-live-status"],
            "--explain-placement: the explanation is part of the live status; drop --no-live-status",
        ),
        (
            ["--allowed-image-prefix", "ghcr.io/ mixrl/"],
            "--allowed-image-prefix: 'ghcr.io/ mixrl/' is not an image prefix",
        ),
        (["--allowed-image-prefix", ""], "--allowed-image-prefix: '' is not an image prefix"),
        (
            ["--allowed-engine-flag", "tokenizer-path"],
            "--allowed-engine-flag: 'tokenizer-path' is not a flag",
        ),
        (["--allowed-engine-flag=--tp=2"], "--allowed-engine-flag: '--tp=2' is not a flag"),
        (
            ["--no-engine-args", "--allowed-engine-flag=--tp"],
            "--allowed-engine-flag: allows nothing with --no-engine-args",
        ),
        (
            ["--allowed-priority-class", "High"],
            "--allowed-priority-class: 'High' is not a DNS subdomain name",
        ),
        (
            ["--priority", "5", "--replica-id", "pod-a"],
            "argument --replica-id: not allowed with argument --priority",
        ),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(
    flags: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["-A", *flags])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"mixrl operator: error: {line}"), error


def test_the_policy_flags_become_the_operators_policy() -> None:
    assert policy_of(parse_args(["-A"])) == OPEN, "no flag, no restriction"
    args = parse_args(
        [
            "-A",
            "--allowed-image-prefix=ghcr.io/mixrl/",
            "--allowed-image-prefix=lmsysorg/sglang:",
            "--allowed-image-prefix=ghcr.io/mixrl/",
            "--allowed-engine-flag=--tokenizer-path",
            "--no-scheduling-overrides",
            "--allowed-priority-class=rl-batch",
        ]
    )
    assert policy_of(args) == Policy(
        allowed_images=("ghcr.io/mixrl/", "lmsysorg/sglang:"),
        allowed_engine_flags=("--tokenizer-path",),
        allow_scheduling=False,
        allowed_priority_classes=("rl-batch",),
    )
    assert not policy_of(parse_args(["-A", "--no-engine-args"])).allow_engine_args


def test_every_default_image_is_pinned_to_this_version() -> None:
    from mixrl import __version__

    images = Images()
    for image in (images.components, images.trainer_torch, images.trainer_megatron, images.torch_engine):
        assert image.endswith(f":{__version__}"), image
    assert not images.sglang.endswith(":latest") and ":" in images.sglang
    assert images_of(parse_args(["-A"])) == images


def test_the_flags_become_the_images_and_conventions_of_every_pod() -> None:
    args = parse_args(
        [
            "-A",
            "--trainer-image=reg/t:1",
            "--megatron-trainer-image=reg/m:1",
            "--torch-engine-image=reg/e@sha256:" + "0" * 64,
            "--sglang-image=reg:5000/sglang:v1",
            "--image-pull-secret=regcred",
            "--image-pull-secret=mirror",
            "--image-pull-secret=regcred",
            "--weights-storage-class=nfs-rwx",
            "--pod-monitor-label=release=kube-prometheus-stack",
            "--gpu-node-label=H100:cloud.google.com/gke-accelerator=nvidia-h100-80gb",
            "--gpu-node-label=H100:pool=gpu",
            "--no-gpu-pod-packing",
            "--scheduler-name=mixrl-packing",
        ]
    )
    images = images_of(args)
    assert not images.pack_gpu_pods and images.scheduler_name == "mixrl-packing"
    assert Images().pack_gpu_pods and Images().scheduler_name is None  # no flag: packed, default scheduler
    assert (images.trainer("torch"), images.trainer("megatron")) == ("reg/t:1", "reg/m:1")
    assert images.engine("sglang") == "reg:5000/sglang:v1" and images.engine("torch").startswith("reg/e@")
    assert images.pull_secrets == ("regcred", "mirror")
    assert images.weights_storage_class == "nfs-rwx"
    assert images.pod_monitor_labels == {"release": "kube-prometheus-stack"}
    assert images.gpu_node_selectors == {
        "H100": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "pool": "gpu"}
    }


def test_replicas_get_distinct_stable_priorities_that_a_developer_and_a_hand_run_outrank() -> None:
    """kopf pauses every operator that sees a live peer of its own priority (all of them, not all but
    one), so replicas must differ: each derives its own from its pod name."""
    names = [f"mixrl-7d9c6b5f4-{suffix}" for suffix in ("2xkqz", "9tlmw", "k8v4p", "zz0qa")]
    priorities = [replica_priority(name) for name in names]
    assert len(set(priorities)) == len(names)
    assert priorities == [replica_priority(name) for name in names], "a restarted container keeps its rank"
    assert all(-(10**9) <= p < 0 for p in priorities)
    assert peering_priority(parse_args(["-A", "--replica-id", names[0]])) == priorities[0]
    assert peering_priority(parse_args(["-A"])) is None  # kopf's default: 0, above every replica
    assert peering_priority(parse_args(["-A", "--dev"])) == DEV_PRIORITY
    assert peering_priority(parse_args(["-A", "--dev", "--replica-id", names[0]])) == DEV_PRIORITY
    assert peering_priority(parse_args(["-A", "--priority", "7"])) == 7


@pytest.mark.slow
async def test_the_operator_command_runs_a_run_and_stops_on_sigterm(api: ApiServer, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG % str(api.url).rstrip("/"))
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path)}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mixrl.cli",
        "operator",
        "--all-namespaces",
        "--dev",
        "--monitoring",
        "annotations",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    try:
        await create(api, small_run())
        # router + two pools (the rollout workers are a StatefulSet)
        await eventually(lambda: len(api.names(DEPLOYMENTS, NAMESPACE)) == 3, timeout=60, what="children")
        tokens = {
            r.headers.get("Authorization")
            for r in list(api)
            if "mixrl-operator" in r.headers.get("User-Agent", "")
        }
        assert tokens == {"Bearer dev-token"}, "our client uses the credentials kopf logged in with"
        peering = api.live("kopf.dev/v1/clusterkopfpeerings", None, "mixrl")
        assert peering is not None and any(
            key.startswith("root@") or "@" in key for key in (peering.get("status") or {})
        ), "the operator announced itself on the peering object"
    finally:
        process.send_signal(signal.SIGTERM)
        api.end_watches()
        output, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
