"""The bed's state and ownership: which processes are the bed's (pid, start time, boot), the
real-node network's owner, Kueue's root check and mount point, and the readiness probes."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mixrl.devcluster import addons, cli, cluster, network
from mixrl.devcluster.cluster import Cluster, ClusterError, ClusterState, process_start
from mixrl.devcluster.kwok_fleet import parse_fleet


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A process that is not the bed's, in a session (and process group) of its own, as every
    process of the bed is."""
    process = subprocess.Popen(["sleep", "120"], start_new_session=True)
    yield process
    process.kill()
    process.wait()


def write_state(
    directory: Path,
    pids: dict[str, int],
    starts: dict[str, int] | None = None,
    boot_id: str | None = None,
    real_nodes: int = 0,
    host_dirs: list[str] | None = None,
) -> None:
    state = ClusterState(str(directory), "/nonexistent", "https://127.0.0.1:1", "t", {}, pids, real_nodes,
                         starts=starts, boot_id=boot_id, host_dirs=host_dirs or [])  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "state.json").write_text(json.dumps(dataclasses.asdict(state)))


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


@pytest.mark.parametrize("mismatch", ["start time", "boot id", "older state"])
def test_a_pid_that_is_not_the_beds_is_never_signalled(
    tmp_path: Path, stranger: subprocess.Popen[bytes], mismatch: str
) -> None:
    start = process_start(stranger.pid)
    assert start is not None
    starts, boot = {
        "start time": ({"kube-apiserver": start + 1}, boot_id()),
        "boot id": ({"kube-apiserver": start}, "another-boot"),
        "older state": (None, None),  # written before mixrl recorded start times
    }[mismatch]
    write_state(tmp_path, {"kube-apiserver": stranger.pid}, starts, boot)
    bed = Cluster(tmp_path)
    status = bed.status()
    assert status["running"] is False and status["components"] == {"kube-apiserver": False}
    lines: list[str] = []
    assert bed.down(log=lines.append) == []
    assert stranger.poll() is None, "down signalled a process that is not the bed's"
    assert not (tmp_path / "state.json").exists()
    (note,) = [line for line in lines if "not signalled" in line]
    assert f"kube-apiserver {stranger.pid}" in note


def test_the_recorded_identity_is_the_childs(tmp_path: Path) -> None:
    bed = Cluster(tmp_path)
    (tmp_path / "logs").mkdir(parents=True)
    # A command name with spaces and parentheses: field 2 of /proc/<pid>/stat shows it as is.
    odd = tmp_path / "a) b (c"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", odd)
    state = ClusterState(str(tmp_path), "/x", "https://127.0.0.1:1", "t", {}, {}, starts={}, boot_id=None)
    bed._start(state, "odd", [str(odd), "120"])
    try:
        pid = state.pids["odd"]
        assert state.boot_id == boot_id()
        ticks = os.sysconf("SC_CLK_TCK")
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        mine = process_start(os.getpid())
        assert mine is not None
        assert state.starts is not None
        assert mine <= state.starts["odd"] <= uptime * ticks + ticks
        assert Cluster(tmp_path).running() == {"odd": True}  # read back from state.json
        assert bed.down(log=lambda _: None) == ["odd"]
        assert not cluster._alive(pid)
    finally:
        cluster._stop(state, ["odd"])


def test_up_cleans_up_after_a_bed_that_was_not_taken_down(
    tmp_path: Path, stranger: subprocess.Popen[bytes]
) -> None:
    """A state whose pids are other programs' now (a reboot): `up` goes on, and leaves them alone."""
    start = process_start(stranger.pid)
    assert start is not None
    write_state(tmp_path, {"etcd": stranger.pid}, starts={"etcd": start + 7}, boot_id=boot_id())
    bed = Cluster(tmp_path)
    lines: list[str] = []
    try:
        bed.up(parse_fleet("cpu=1"), volumes=0, log=lines.append)
        assert any("cleaning up what it left" in line for line in lines)
        assert stranger.poll() is None
        status = bed.status()
        assert status["running"] and status["ready_nodes"] == 1, status
    finally:
        bed.down(log=lambda _: None)
    assert stranger.poll() is None


# ----------------------------------------------------------------------------- the network's owner


@pytest.fixture
def owner_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "owner.json"
    monkeypatch.setattr(cluster, "NETWORK_OWNER", path)
    return path


@pytest.fixture
def network_commands(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every command the bed's network would run, recorded instead of run."""
    ran: list[list[str]] = []
    monkeypatch.setattr(network, "_run", lambda command, input=None, check=True: ran.append(command))
    return ran


def test_a_second_real_node_bed_refuses_while_the_first_runs(
    tmp_path: Path, owner_file: Path, network_commands: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "first-bed"
    cluster._claim_network(other, os.getpid())  # this test's process stands for its API server
    assert cluster.network_owner() == str(other.resolve())

    def no_build() -> Path:
        raise AssertionError("up went past the check")

    monkeypatch.setattr(cluster, "binaries_dir", no_build)
    with pytest.raises(ClusterError) as refused:
        Cluster(tmp_path / "second-bed").up([], real_nodes=1, log=lambda _: None)
    assert str(refused.value) == (
        f"--real-nodes: the bed in {other.resolve()} runs real nodes (one bed at a time: their network's "
        f"names are fixed): `mixrl dev-cluster --dir {other.resolve()} down` first"
    )
    assert network_commands == []
    assert json.loads(owner_file.read_text())["dir"] == str(other.resolve())


def test_a_stale_owner_is_taken_over(owner_file: Path, stranger: subprocess.Popen[bytes]) -> None:
    start = process_start(stranger.pid)
    assert start is not None
    owner = {"dir": "/elsewhere", "pid": stranger.pid, "start": start, "boot_id": boot_id()}
    owner_file.write_text(json.dumps(owner))
    assert cluster.network_owner() == "/elsewhere"
    owner_file.write_text(json.dumps({**owner, "start": start + 1}))  # its pid, another process
    assert cluster.network_owner() is None
    owner_file.write_text(json.dumps({**owner, "boot_id": "another-boot"}))
    assert cluster.network_owner() is None
    owner_file.write_text("{not json")
    assert cluster.network_owner() is None


def test_down_leaves_the_network_to_the_bed_that_took_it_over(
    tmp_path: Path, owner_file: Path, network_commands: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    cleaned: list[str] = []
    monkeypatch.setattr(cluster.real_node, "clean_node", lambda bed, node: cleaned.append(node.name))
    mine = tmp_path / "stale-bed"
    write_state(mine, {}, real_nodes=1, starts={}, boot_id=boot_id())
    cluster._claim_network(tmp_path / "live-bed", os.getpid())
    lines: list[str] = []
    Cluster(mine).down(log=lines.append)
    assert network_commands == [] and cleaned == []
    assert any("left to it" in line for line in lines)
    assert owner_file.exists(), "the live bed's record stays"
    # Once that bed is gone too, down cleans up as before and forgets the owner it was.
    cluster._claim_network(mine, os.getpid())
    write_state(mine, {}, real_nodes=1, starts={}, boot_id=boot_id())
    Cluster(mine).down(log=lambda _: None)
    assert cleaned == ["mixrl-node-0"] and ["ip", "link", "del", network.BRIDGE] in network_commands
    assert not owner_file.exists()


# ----------------------------------------------------------------------------- Kueue


def test_kueue_needs_root_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)

    def no_up(*args: object, **kwargs: object) -> None:
        raise AssertionError("the bed started")

    monkeypatch.setattr(Cluster, "up", no_up)
    assert cli.main(["--dir", str(tmp_path), "up", "--fleet", "cpu=1", "--kueue"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mixrl dev-cluster: --kueue: needs root")
    # From Python too (the tests' fixtures), before Kueue is built.
    monkeypatch.setattr(addons, "addon_dir", no_up)
    state = ClusterState(str(tmp_path), "/x", "https://127.0.0.1:1", "t", {}, {})
    with pytest.raises(ClusterError, match="--kueue: needs root"):
        addons.start_addon(Cluster(tmp_path), state, "kueue")


def test_the_cli_reports_an_os_error_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", "/run/mixrl-bed-owner.json")

    monkeypatch.setattr(Cluster, "down", refused)
    assert cli.main(["--dir", str(tmp_path), "down"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "mixrl dev-cluster: [Errno 13] Permission denied: '/run/mixrl-bed-owner.json'"
    ]


def test_the_mount_point_the_bed_made_goes_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    existing = tmp_path / "etc"
    existing.mkdir()
    mount_point = existing / "kueue" / "metrics" / "certs"
    assert addons.make_dirs(mount_point) == [existing / "kueue", existing / "kueue" / "metrics", mount_point]
    assert addons.make_dirs(mount_point) == []
    bed = tmp_path / "bed"
    made = [str(existing / "kueue"), str(existing / "kueue" / "metrics"), str(mount_point)]
    # stop_addon removes it once the manager stopped...
    spec = dataclasses.replace(addons.ADDONS["kueue"], metrics_cert_dir=str(mount_point))
    monkeypatch.setitem(addons.ADDONS, "kueue", spec)
    state = ClusterState(str(bed), "/x", "https://127.0.0.1:1", "t", {}, {}, host_dirs=list(made))
    bed.mkdir()
    addons.stop_addon(Cluster(bed), state, "kueue")
    assert not (existing / "kueue").exists() and existing.exists() and state.host_dirs == []
    # ... and down does, for a bed whose add-on was never stopped on its own.
    addons.make_dirs(mount_point)
    write_state(bed, {}, host_dirs=made)
    Cluster(bed).down(log=lambda _: None)
    assert not (existing / "kueue").exists() and existing.exists()


# ----------------------------------------------------------------------------- readiness probes


def test_dns_probe_wants_an_answer_to_its_own_query() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        replies = iter([(0, 1), (3, 0), (0, 0)])  # (rcode, answers): an A record, NXDOMAIN, empty

        def serve() -> None:
            for rcode, answers in replies:
                query, peer = server.recvfrom(512)
                header = struct.pack(
                    "!6H", struct.unpack("!H", query[:2])[0], 0x8180 | rcode, 1, answers, 0, 0
                )
                server.sendto(header + query[12:], peer)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        name = "kubernetes.default.svc.cluster.local"
        assert cluster._dns_answers("127.0.0.1", name, port) is True
        assert cluster._dns_answers("127.0.0.1", name, port) is False
        assert cluster._dns_answers("127.0.0.1", name, port) is False
        thread.join(5)
    assert cluster._dns_answers("127.0.0.1", name, port) is False  # nobody listens
