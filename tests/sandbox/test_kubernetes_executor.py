"""``mixrl sandbox-exec`` as a real process on loopback, and KubernetesSandbox leasing real executors.

The pods of the second half are stand-ins (a :class:`PodClient` in memory that starts one
executor process per pod on its own loopback address); what runs in them is the real executor.
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import resolve
from mixrl.operator.builders import sandbox as B
from mixrl.operator.builders.objects import Images, Owner
from mixrl.rl.sandbox import Limits, SandboxUnavailable
from mixrl.rl.sandbox.executor import decode_result, encode_request
from mixrl.rl.sandbox.kubernetes import KubernetesSandbox, SandboxPods
from mixrl.rl.sandbox.lease import WORKER_LABEL

from .pods import InstantPods, executor_template

Obj = dict[str, Any]
ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_executor(host: str, port: int, work_dir: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "MIXRL_HOST_SECRET": "do-not-leak"}
    return subprocess.Popen(
        [sys.executable, "-m", "mixrl.cli", "sandbox-exec", "--host", host, "--port", str(port),
         "--work-dir", str(work_dir)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def wait_listening(host: str, port: int, process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the executor exited"
        with socket.socket() as probe:
            if probe.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"the executor did not listen on {host}:{port}")


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    work = tmp_path_factory.mktemp("executor-work")
    port = free_port()
    process = start_executor("127.0.0.1", port, work)
    try:
        wait_listening("127.0.0.1", port, process)
        yield f"http://127.0.0.1:{port}", work
    finally:
        process.kill()
        process.wait()


async def post(url: str, body: Obj) -> tuple[int, Obj]:
    async with aiohttp.ClientSession() as session, session.post(f"{url}/run", json=body) as response:
        return response.status, await response.json()


def run(url: str, command: str, files: Mapping[str, str] | None = None, **limits: Any) -> Any:
    status, answer = asyncio.run(post(url, encode_request(command, files or {}, Limits(**limits))))
    assert status == 200, answer
    return decode_result(answer)


def test_a_command_gets_its_files_and_gives_back_what_it_left(executor: tuple[str, Path]) -> None:
    url, work = executor
    result = run(
        url, "cat in/a.txt; echo new > out.txt; rm in/a.txt; echo err >&2; exit 3", {"in/a.txt": "hi"}
    )
    assert (result.finish_reason, result.exit_code) == ("ok", 3)
    assert result.stdout == "hi" and result.stderr == "err\n"
    assert result.files == {"out.txt": b"new\n"}
    assert list(work.iterdir()) == []  # the command's directory is gone


def test_the_environment_is_the_commands_own(executor: tuple[str, Path]) -> None:
    result = run(executor[0], "env; pwd")
    assert "do-not-leak" not in result.stdout and "MIXRL_HOST_SECRET" not in result.stdout
    assert f"HOME={result.stdout.splitlines()[-1]}" in result.stdout


def test_the_wall_clock_ends_it_and_kills_what_it_left_running(executor: tuple[str, Path]) -> None:
    marker = f"mixrlmarker{random.randrange(10**9)}"
    started = time.monotonic()
    result = run(executor[0], f"sh -c 'sleep 300; echo {marker}' & sleep 301", wall_s=1)
    assert result.finish_reason == "timeout" and result.exit_code is None
    assert "wall clock limit 1 s" in result.detail
    assert time.monotonic() - started < 10
    for _ in range(50):  # killed processes may take a moment to be reaped (was a fixed 0.2 s)
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
        if left == "":
            break
        time.sleep(0.05)
    assert left == ""


def test_what_a_command_leaves_in_a_session_of_its_own_is_killed_at_its_end(
    executor: tuple[str, Path],
) -> None:
    """A background process that left the command's group (and, with a double fork, its tree)
    holds the command's pipes; the command's end is still its end, and the process goes with it."""
    marker = f"mixrlmarker{random.randrange(10**9)}"
    daemon = f"setsid sh -c 'sleep 300; echo {marker}' &"
    started = time.monotonic()
    result = run(executor[0], f'sh -c "{daemon}"; echo done', wall_s=30)
    assert (result.finish_reason, result.exit_code, result.stdout) == ("ok", 0, "done\n"), result
    assert time.monotonic() - started < 10
    for _ in range(50):
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
        if left == "":
            break
        time.sleep(0.05)
    assert left == ""


def test_an_output_flood_is_cut_and_stopped(executor: tuple[str, Path]) -> None:
    result = run(executor[0], "yes", output_bytes=4096, wall_s=20)
    assert result.finish_reason == "output_limit" and "stdout passed 4096 bytes" in result.detail
    assert result.stdout.startswith("y\ny\n") and "output truncated at 4096 bytes" in result.stdout
    assert len(result.stdout) < 4096 + 100


def test_cpu_memory_and_file_size_limits_have_their_finish_reasons(executor: tuple[str, Path]) -> None:
    url = executor[0]
    cpu = run(url, "while :; do :; done", cpu_s=1, wall_s=20)
    assert (cpu.finish_reason, cpu.detail) == ("timeout", "cpu time limit 1 s")
    memory = run(url, "python3 -c 'x = bytearray(400 * 2**20)'", memory_bytes=200 * 2**20)
    assert memory.finish_reason == "memory", memory
    big = run(url, "head -c 3000000 /dev/zero > big", file_bytes=2**20)
    assert big.finish_reason == "disk" and "file size limit" in big.detail
    left = run(url, "head -c 900000 /dev/zero > a; head -c 900000 /dev/zero > b", disk_bytes=2**20)
    assert left.finish_reason == "disk" and "more than 1048576" in left.detail and left.files is None


def test_links_out_of_the_directory_do_not_come_back(executor: tuple[str, Path]) -> None:
    result = run(executor[0], "ln -s /etc/passwd p; mkdir d; ln -s / d/root; echo x > d/ok")
    assert result.files == {"d/ok": b"x\n"}
    assert any("'p'" in note for note in result.dropped)


def test_a_bad_request_is_refused_naming_its_field(executor: tuple[str, Path]) -> None:
    url = executor[0]
    for body, field in (
        ({"command": ""}, "command"),
        ({"command": "true", "files": {"../x": base64.b64encode(b"x").decode()}}, "climbs out"),
        ({"command": "true", "limits": {"wall_s": -1}}, "limits.wall_s"),
        ({"command": "true", "limits": {"walls": 1}}, "limits: unknown fields"),
    ):
        status, answer = asyncio.run(post(url, body))
        assert status == 400 and field in answer["error"], answer


def test_temporary_files_neither_come_back_nor_count_to_disk(executor: tuple[str, Path]) -> None:
    """As the local backend's /tmp: TMPDIR is outside the directory whose files come back."""
    url, work = executor
    scratch = "import os, tempfile; open(os.path.join(tempfile.mkdtemp(), 's'), 'wb').write(bytes(900000))"
    where = 'case "$TMPDIR" in "$PWD"*) echo inside;; *) echo outside;; esac'
    result = run(url, f'python3 -c "{scratch}"; head -c 900000 /dev/zero > kept; {where}', disk_bytes=2**20)
    assert (result.finish_reason, result.stdout) == ("ok", "outside\n"), result
    assert list(result.files) == ["kept"]
    assert list(work.iterdir()) == []  # the temporary directory went too


def test_files_in_each_others_way_or_a_nul_in_the_command_are_refused_not_a_failure(
    executor: tuple[str, Path],
) -> None:
    """What the local backend refuses with ValueError before running anything is a 400, not a 500."""
    x = base64.b64encode(b"x").decode()
    for body, error in (
        ({"command": "true", "files": {"a": x, "a/b": x}}, "both a file and the directory"),
        ({"command": "echo a\x00b"}, "null byte"),
    ):
        status, answer = asyncio.run(post(executor[0], body))
        assert status == 400 and error in answer["error"], answer


def test_files_the_command_made_unreadable_are_dropped_with_a_note() -> None:
    """The executor as a user that permissions bind (as in the pod; root reads anything)."""
    work = Path(tempfile.mkdtemp(prefix="mixrl-executor-"))  # in /tmp: pytest's own is root's only
    as_nobody: list[str] = []
    if os.geteuid() == 0:
        os.chown(work, NOBODY, NOBODY)
        as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    port = free_port()
    process = subprocess.Popen(
        [*as_nobody, sys.executable, "-m", "mixrl.cli", "sandbox-exec", "--port", str(port),
         "--work-dir", str(work)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_listening("127.0.0.1", port, process)
        command = (
            "echo x > ok; echo y > secret; chmod 000 secret; mkdir shut; chmod 000 shut; "
            "mkdir listed; echo z > listed/f; chmod 600 listed; echo done"
        )
        result = run(f"http://127.0.0.1:{port}", command)
    finally:
        process.kill()
        process.wait()
        subprocess.run(["chmod", "-R", "u+rwX", str(work)], check=False)
        shutil.rmtree(work, ignore_errors=True)
    assert (result.finish_reason, result.stdout, result.files) == ("ok", "done\n", {"ok": b"x\n"})
    for name in ("secret", "shut", "listed/f"):
        assert any(note.startswith(f"'{name}': cannot be read") for note in result.dropped), result.dropped


# ----------------------------------------------------------------------------- KubernetesSandbox


async def test_an_answer_that_is_not_a_result_is_unavailable_not_a_killed_command() -> None:
    """A server error or a page that is not the executor's JSON: no result to score (it was
    `killed`, a zero reward trained on)."""
    answers = [(503, "<html>503 Service Unavailable</html>"), (200, "<html>a proxy's page</html>")]

    async def answer(_: web.Request) -> web.Response:
        status, text = answers.pop(0)
        return web.Response(status=status, text=text, content_type="text/html")

    app = web.Application()
    app.router.add_post("/run", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()

    pods = SandboxPods(InstantPods(ip="127.0.0.1"), executor_template(port), worker="w", size=1, poll_s=0.02)
    sandbox = KubernetesSandbox(pods)
    await sandbox.start()
    try:
        with pytest.raises(SandboxUnavailable, match="503 <html>503 Service Unavailable"):
            await sandbox.run("true")
        with pytest.raises(SandboxUnavailable, match="not a JSON answer: 200 <html>a proxy"):
            await sandbox.run("true")
    finally:
        await sandbox.close()
        await runner.cleanup()


class LoopbackPods:
    """A PodClient whose every pod is a real executor process on an address of its own in 127/8."""

    def __init__(self, work: Path, port: int) -> None:
        self.work, self.port = work, port
        self.pods: dict[str, tuple[Obj, subprocess.Popen[bytes], str]] = {}
        self.created: list[str] = []
        self.deleted: list[str] = []
        self.next = random.randrange(2, 200)

    async def create(self, pod: Obj) -> None:
        name = pod["metadata"]["name"]
        self.next += 1
        address = f"127.0.{self.next // 250}.{self.next % 250 + 2}"
        directory = self.work / name
        directory.mkdir()
        self.pods[name] = (pod, start_executor(address, self.port, directory), address)
        self.created.append(name)

    async def get(self, name: str) -> Obj | None:
        if name not in self.pods:
            return None
        pod, _, address = self.pods[name]
        with socket.socket() as probe:
            up = probe.connect_ex((address, self.port)) == 0
        status = {"phase": "Running", "podIP": address, "conditions": [{"type": "Ready", "status": str(up)}]}
        return {**pod, "status": status}

    async def list(self, labels: Mapping[str, str]) -> list[Obj]:
        return [
            pod
            for pod, _, _ in self.pods.values()
            if all(pod["metadata"]["labels"].get(k) == v for k, v in labels.items())
        ]

    async def delete(self, name: str) -> None:
        if name in self.pods:
            _, process, _ = self.pods.pop(name)
            process.kill()
            process.wait()
            self.deleted.append(name)

    def stop(self) -> None:
        for name in list(self.pods):
            asyncio.run(self.delete(name))

    def play(self, scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``scenario`` to its end, then stop the executors of the pods it left."""
        try:
            asyncio.run(scenario())
        finally:
            self.stop()


def template() -> Obj:
    manifest = {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "demo", "namespace": "rl"},
        "spec": {
            "model": {"path": "tiny:qwen3"},
            "trainer": {"gpuType": "cpu"},
            "samplerPools": [{"name": "cpu", "gpuType": "cpu", "engine": "torch", "weightPrecision": "bf16"}],
            "rollout": {"environment": "coding", "sandbox": {"poolSize": 2}},
        },
    }
    run = parse_document(manifest)
    assert isinstance(run, RLRun)
    return B.sandbox_pod_template(resolve(run), Owner("mixrl.dev/v1alpha1", "RLRun", "demo", "u"), Images())


@asynccontextmanager
async def leased_sandbox(
    client: LoopbackPods, worker: str, size: int = 1, ready_timeout_s: float = 30, poll_s: float = 0.1
) -> AsyncIterator[KubernetesSandbox]:
    """A started KubernetesSandbox of ``size`` pods of :func:`template` on ``client``; closed at the end."""
    pods = SandboxPods(
        client, template(), worker=worker, size=size, ready_timeout_s=ready_timeout_s, poll_s=poll_s
    )
    sandbox = KubernetesSandbox(pods)
    await sandbox.start()
    try:
        yield sandbox
    finally:
        await sandbox.close()


def test_each_command_runs_in_a_fresh_pod_and_every_pod_goes_at_close(tmp_path: Path) -> None:
    client = LoopbackPods(tmp_path, B.EXECUTOR_PORT)
    stale = {"kind": "Pod", "metadata": {"name": "old", "labels": {WORKER_LABEL: "w-0"}}}

    async def scenario() -> None:
        client.pods["old"] = (
            stale,
            subprocess.Popen(["sleep", "60"]),
            "127.9.9.9",
        )  # an earlier incarnation's
        async with leased_sandbox(client, "w-0", size=2) as sandbox:
            assert "old" in client.deleted
            first = await sandbox.run("echo one > f; cat f", {"seed.txt": "s"})
            assert (first.finish_reason, first.stdout) == ("ok", "one\n")
            assert first.files == {"f": b"one\n", "seed.txt": b"s"}
            # the next command finds nothing of the last one: another pod, another directory
            second = await sandbox.run("ls")
            assert second.stdout == "" and second.files == {}
            results = await asyncio.gather(*(sandbox.run(f"echo {i}") for i in range(3)))
            assert [r.stdout for r in results] == ["0\n", "1\n", "2\n"]
            stuck = await sandbox.run("sleep 30", limits=Limits(wall_s=1))
            assert stuck.finish_reason == "timeout"
            assert len(set(client.created)) == len(client.created) >= 6  # no pod leased twice
        assert client.pods == {}  # every pod deleted on shutdown

    client.play(scenario)


def test_a_command_that_kills_its_executor_ends_killed_and_its_pod_goes(tmp_path: Path) -> None:
    client = LoopbackPods(tmp_path, B.EXECUTOR_PORT)

    async def scenario() -> None:
        async with leased_sandbox(client, "w-1") as sandbox:
            # prlimit execs the shell, so its parent is the executor: the same user in the same pod
            suicide = await sandbox.run("kill -9 $PPID; sleep 5")
            assert suicide.finish_reason == "killed" and "did not answer" in suicide.detail
        assert client.pods == {}

    client.play(scenario)


def test_no_ready_pod_in_time_is_a_clear_error(tmp_path: Path) -> None:
    class NeverReady(LoopbackPods):
        async def create(self, pod: Obj) -> None:
            self.pods[pod["metadata"]["name"]] = (pod, subprocess.Popen(["sleep", "60"]), "127.9.9.8")

    client = NeverReady(tmp_path, B.EXECUTOR_PORT)

    async def scenario() -> None:
        async with leased_sandbox(client, "w-2", ready_timeout_s=0.5, poll_s=0.05) as sandbox:
            with pytest.raises(
                SandboxUnavailable, match=r"none became ready within 1 s \(.*not ready after 0.5 s"
            ):
                await sandbox.run("true")

    client.play(scenario)
