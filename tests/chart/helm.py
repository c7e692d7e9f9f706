"""Running Helm (its Go library, through helm-sdkpy, which needs Python ≥ 3.12) in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import textwrap
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "mixrl"
HELM_PYTHON = ROOT / ".venv-helm" / "bin" / "python"

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: emulator, cluster: {server: "%s"}}]
users: [{name: tester, user: {token: test}}]
contexts: [{name: emulator, context: {cluster: emulator, user: tester, namespace: default}}]
current-context: emulator
"""

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from helm_sdkpy import Configuration, Install, Lint
    request = json.loads(sys.stdin.read())
    config = Configuration(namespace=request["namespace"], kubeconfig=request.get("kubeconfig"))
    try:
        if request["action"] == "lint":
            result = asyncio.run(Lint(config).run(request["chart"]))
        else:
            result = asyncio.run(Install(config).run(
                request["release"], request["chart"], values=request["values"], wait=False, timeout=60))
        print(json.dumps({"ok": True, "result": result}, default=str))
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
    """
)


async def run_helm(request: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    # The release record lives in memory: Helm would store it as a protobuf-encoded Secret.
    env = {**os.environ, "HELM_DRIVER": "memory", "HOME": str(request.pop("home"))}
    process = await asyncio.create_subprocess_exec(
        str(HELM_PYTHON),
        "-c",
        SCRIPT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(process.communicate(json.dumps(request).encode()), timeout)
    if process.returncode != 0 or not out.strip():
        raise RuntimeError(f"helm subprocess failed ({process.returncode}): {err.decode()[-2000:]}")
    answer: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return answer


async def lint(chart: Path, home: Path) -> dict[str, Any]:
    return await run_helm({"action": "lint", "chart": str(chart), "namespace": "default", "home": home})


async def install(
    server_url: str,
    values: dict[str, Any],
    home: Path,
    namespace: str = "mixrl-system",
    release: str = "mixrl",
) -> dict[str, Any]:
    kubeconfig = home / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG % server_url.rstrip("/"))
    return await run_helm(
        {
            "action": "install",
            "chart": str(CHART),
            "namespace": namespace,
            "release": release,
            "values": values,
            "kubeconfig": str(kubeconfig),
            "home": home,
        }
    )


def chart_with_values(values: dict[str, Any], directory: Path) -> Path:
    """A copy of the chart whose values.yaml is ``values`` (lint reads only the chart's own values)."""
    copy = directory / "mixrl"
    shutil.copytree(CHART, copy)
    (copy / "values.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    return copy


def default_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def everything_on() -> dict[str, Any]:
    values = default_values()
    for feature in ("podMonitor", "prometheusRule", "grafanaDashboard"):
        values["monitoring"][feature]["enabled"] = True
    return values


def namespaced(*namespaces: str) -> dict[str, Any]:
    values = everything_on()
    values["watch"] = {"allNamespaces": False, "namespaces": list(namespaces)}
    return values
