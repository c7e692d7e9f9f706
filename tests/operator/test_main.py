"""`mixrl operator` as a process: kubeconfig login (--dev), peering, reconcile, clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from .emulator import ApiServer
from .support import DEPLOYMENTS, NAMESPACE, create, eventually, small_run

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: emulator, cluster: {server: "%s"}}]
users: [{name: dev, user: {token: dev-token}}]
contexts: [{name: emulator, context: {cluster: emulator, user: dev}}]
current-context: emulator
"""

pytestmark = pytest.mark.slow


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
