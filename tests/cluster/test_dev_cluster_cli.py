"""``mixrl dev-cluster up|status|down`` as a person runs it: a second, small control plane beside the
session's, up within the issue's 30 s, reachable with the kubeconfig it writes, and nothing left
running after ``down``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mixrl.devcluster.cluster import binaries_dir


def mixrl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mixrl.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1][0] != "Z"


def test_up_status_down(tmp_path: Path) -> None:
    run_dir = tmp_path / "bed"
    started = time.monotonic()
    up = mixrl("dev-cluster", "--dir", str(run_dir), "up", "--fleet", "H100=2x4,cpu=1")
    took = time.monotonic() - started
    assert up.returncode == 0, up.stderr
    try:
        assert took < 30, f"dev-cluster up took {took:.1f} s"
        assert "3 nodes Ready" in up.stdout
        status = mixrl("dev-cluster", "--dir", str(run_dir), "status", "--json")
        assert status.returncode == 0
        report = json.loads(status.stdout)
        assert report["readyz"] is True and report["ready_nodes"] == 3
        nodes = subprocess.run(
            [str(binaries_dir() / "kubectl"), f"--kubeconfig={report['kubeconfig']}", "get", "nodes",
             "-l", "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3", "-o", "name"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert len(nodes) == 2
        again = mixrl("dev-cluster", "--dir", str(run_dir), "up")
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        pids = json.loads((run_dir / "state.json").read_text())["pids"]
        down = mixrl("dev-cluster", "--dir", str(run_dir), "down")
    assert down.returncode == 0
    assert not [name for name, pid in pids.items() if alive(pid)]
    assert mixrl("dev-cluster", "--dir", str(run_dir), "status").returncode == 1
    assert (run_dir / "logs" / "kube-apiserver.log").exists()  # logs are kept for a post-mortem
