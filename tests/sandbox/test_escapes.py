"""Escape attempts against the real bubblewrap sandbox: each is contained, ends with the right finish
reason, and leaves nothing on the host (files, processes, connections)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from mixrl.rl.sandbox import Limits, Sandbox, SandboxConfig, SandboxUnavailable
from mixrl.rl.sandbox.processes import kill_process_tree

from .conftest import host_processes, host_uid, needs_bwrap

pytestmark = needs_bwrap
QUICK = Limits(wall_s=3.0, cpu_s=1, processes=16)


async def test_a_plain_command_sees_its_files_and_hands_back_what_it_wrote(sandbox: Sandbox) -> None:
    files = {"a.txt": "hello\n", "pkg/mod.py": "print('from the module')\n"}
    result = await sandbox.run("cat a.txt && python3 pkg/mod.py && echo made > out.txt && id -u", files)
    assert result.finish_reason == "ok" and result.exit_code == 0, result
    assert result.stdout.split("\n")[:3] == ["hello", "from the module", "1000"]
    assert result.files == {
        "a.txt": b"hello\n",
        "pkg/mod.py": files["pkg/mod.py"].encode(),
        "out.txt": b"made\n",
    }


async def test_writing_outside_the_working_directory_fails_and_reaches_no_host_path(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    host_dir = tmp_path / "host"
    host_dir.mkdir(mode=0o777)
    targets = [str(host_dir / "evil"), "/usr/evil", "/etc/evil", "/seed/evil", "/evil", "/proc/evil"]
    command = "; ".join(f"echo pwned > {target}" for target in targets) + "; echo survived"
    result = await sandbox.run(command, {"keep.txt": "x"}, QUICK)
    assert result.finish_reason == "ok" and result.stdout == "survived\n", result
    assert result.stderr.count("cannot create") == len(targets), result.stderr
    for target in targets:
        assert not os.path.exists(target), target
    assert list(host_dir.iterdir()) == []


async def test_no_network_not_even_the_hosts_loopback(sandbox: Sandbox) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept)
    thread.start()
    probe = (
        "import socket\n"
        "for host in ('127.0.0.1', '10.0.0.1', '8.8.8.8'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port}), timeout=1); print(host, 'connected')\n"
        "    except OSError as error: print(host, error.errno)\n"
        "socket.getaddrinfo('example.com', 80)\n"
    )
    try:
        result = await sandbox.run("python3 probe.py", {"probe.py": probe}, QUICK)
    finally:
        stop.set()
        thread.join()
        listener.close()
    assert "connected" not in result.stdout, result.stdout
    assert result.stdout.count("\n") == 3 and "gaierror" in result.stderr, result
    assert accepted == []


async def test_a_fork_bomb_stays_under_the_process_limit_and_dies_with_the_sandbox(
    sandbox: Sandbox, token: str
) -> None:
    limits = Limits(wall_s=2.0, cpu_s=2, processes=16)
    seen: list[int] = []

    async def watch() -> None:
        while True:
            seen.append(len(host_processes(token)))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    started = time.monotonic()
    # `exec`: the wait after the bomb needs no fork of its own (the bomb may hold every slot)
    result = await sandbox.run(f"bomb() {{ bomb | bomb & }}; bomb; exec sleep 30 # {token}", {}, limits)
    watcher.cancel()
    assert result.finish_reason == "timeout" and result.exit_code is None, result
    assert time.monotonic() - started < limits.wall_s + 2
    assert "Cannot fork" in result.stderr  # it did reach the limit
    assert 0 < max(seen) <= limits.processes, seen
    assert host_processes(token) == []


async def test_filling_the_disk_stops_at_the_tmpfs_size(sandbox: Sandbox) -> None:
    limits = Limits(wall_s=5.0, disk_bytes=8 * 2**20, file_bytes=2**20)
    command = "i=0; while [ $i -lt 100 ]; do head -c 1048576 /dev/zero > f$i || exit 1; i=$((i+1)); done"
    result = await sandbox.run(command, {}, limits)
    assert result.finish_reason == "disk" and result.exit_code == 1, result
    assert "No space left on device" in result.stderr
    assert result.files is not None and sum(map(len, result.files.values())) <= limits.disk_bytes


async def test_dev_holds_only_device_nodes_so_memory_backed_space_obeys_the_disk_limit(
    sandbox: Sandbox,
) -> None:
    """/dev is a tmpfs of half the host's memory: before, 2 GB went to /dev/shm against 64 MiB."""
    limits = Limits(wall_s=5.0, disk_bytes=8 * 2**20, file_bytes=2**20)
    command = (
        "echo discarded > /dev/null && echo null-ok; "
        "for place in /dev/shm /dev; do head -c 4096 /dev/zero > $place/f && echo wrote $place; done; "
        "mkdir /dev/d && echo made /dev/d; exit 0"
    )
    result = await sandbox.run(command, {}, limits)
    assert result.finish_reason == "ok" and result.exit_code == 0, result
    assert result.stdout == "null-ok\n"  # device nodes work; nothing could be written in /dev
    assert result.stderr.count("Read-only file system") == 3, result.stderr


async def test_files_too_big_for_the_working_directory_end_with_disk(sandbox: Sandbox) -> None:
    result = await sandbox.run("echo never", {"big.bin": b"x" * 2**21}, Limits(disk_bytes=2**20))
    assert result.finish_reason == "disk" and result.exit_code is None and result.stdout == "", result
    assert result.detail == "the files passed 1048576 bytes"


async def test_one_file_past_the_file_size_limit_ends_with_sigxfsz(sandbox: Sandbox) -> None:
    limits = Limits(wall_s=5.0, file_bytes=2**20)
    result = await sandbox.run("head -c 5000000 /dev/zero > big", {}, limits)
    assert result.finish_reason == "disk" and result.exit_code == 128 + 25, result
    assert result.files is not None and len(result.files["big"]) == limits.file_bytes


async def test_python_past_the_file_size_limit_ends_with_disk(sandbox: Sandbox) -> None:
    # Python ignores SIGXFSZ: its write fails with EFBIG ("File too large"); before, that read `ok`.
    write = "open('big', 'wb').write(bytes(5_000_000))\n"
    result = await sandbox.run("python3 write.py", {"write.py": write}, Limits(wall_s=5.0, file_bytes=2**20))
    assert result.finish_reason == "disk" and result.exit_code == 1, result
    assert "File too large" in result.stderr and result.detail == "file size limit 1048576 bytes"


async def test_unbounded_memory_ends_with_memory(sandbox: Sandbox) -> None:
    grow = "x = []\nwhile True:\n    x.append(bytearray(2**20))\n"
    result = await sandbox.run(
        "python3 grow.py", {"grow.py": grow}, Limits(wall_s=5.0, memory_bytes=128 * 2**20)
    )
    assert result.finish_reason == "memory" and result.exit_code == 1, result
    assert "MemoryError" in result.stderr


async def test_sleeping_forever_ends_at_the_wall_clock_with_nothing_left_behind(
    sandbox: Sandbox, token: str
) -> None:
    result = await sandbox.run(f"(sleep 1000 # {token}\n) & sleep 1000 # {token}", {}, Limits(wall_s=1.0))
    assert result.finish_reason == "timeout" and result.detail == "wall clock limit 1.0 s", result
    assert 1.0 <= result.wall_s < 2.5
    assert host_processes(token) == []


async def test_a_background_process_does_not_outlive_its_command(sandbox: Sandbox, token: str) -> None:
    result = await sandbox.run(f"(sleep 1000 # {token}\n) & echo left", {}, QUICK)
    assert result.finish_reason == "ok" and result.stdout == "left\n", result
    assert result.wall_s < 1.5
    assert host_processes(token) == []


async def test_open_files_stop_at_their_limit_and_the_hostname_is_the_sandboxes(sandbox: Sandbox) -> None:
    probe = "import errno\nfiles = []\ntry:\n    while True: files.append(open('/dev/null'))\nexcept OSError as e: print(e.errno == errno.EMFILE, len(files))\n"
    result = await sandbox.run(
        "python3 probe.py; cat /proc/sys/kernel/hostname", {"probe.py": probe}, Limits(open_files=16)
    )
    emfile, opened, hostname = result.stdout.split()
    assert emfile == "True" and int(opened) < 16 and hostname == "sandbox", result


async def test_burning_cpu_ends_at_the_cpu_limit(sandbox: Sandbox) -> None:
    result = await sandbox.run("python3 -c 'while True: pass'", {}, Limits(wall_s=5.0, cpu_s=1))
    assert result.finish_reason == "timeout" and result.exit_code == 128 + 24, result
    assert result.detail == "cpu time limit 1 s"


async def test_endless_output_is_cut_at_the_cap(sandbox: Sandbox) -> None:
    result = await sandbox.run("yes; echo never", {}, Limits(wall_s=5.0, output_bytes=4096))
    assert result.finish_reason == "output_limit" and result.exit_code is None, result
    assert result.stdout.startswith("y\ny\n") and result.stdout.endswith(
        "[mixrl sandbox: output truncated at 4096 bytes]\n"
    )
    assert len(result.stdout) < 4096 + 100
    assert result.wall_s < 2.0


async def test_host_secrets_are_not_visible(
    sandbox: Sandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's secret\n")
    monkeypatch.setenv("MIXRL_TEST_SECRET", "the-host-env-secret")
    command = (
        f"cat {secret}; cat /etc/shadow /etc/passwd /root/.bashrc; ls /home /var /run; "
        "env; cat /proc/*/environ | tr '\\0' '\\n'; ps -eo pid,cmd"
    )
    result = await sandbox.run(command, {}, QUICK)
    everything = result.stdout + result.stderr
    assert "the host's secret" not in everything and "the-host-env-secret" not in everything
    assert f"cat: {secret}: No such file or directory" in result.stderr
    processes = [line for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(processes) <= 5, processes  # its own init, shells and ps: no host process


async def test_links_and_odd_names_left_in_work_do_not_come_back(sandbox: Sandbox) -> None:
    result = await sandbox.run("ln -s /etc/passwd link; mkfifo pipe; echo ok > plain", {}, QUICK)
    assert result.files == {"plain": b"ok\n"}
    assert len(result.dropped) == 2 and all("not a regular file" in note for note in result.dropped)


async def test_a_file_name_that_is_not_utf8_is_reported_escaped_and_never_comes_back(
    sandbox: Sandbox,
) -> None:
    result = await sandbox.run("echo x > \"$(printf 'bad\\377name')\"; echo ok > plain", {}, QUICK)
    assert result.files == {"plain": b"ok\n"}
    assert result.dropped == ("files: './bad\\\\xffname': not a UTF-8 file name",)
    assert all(note.encode("utf-8") for note in result.dropped)  # no lone surrogate left to break a tokenizer


async def test_killing_its_own_wrapper_ends_the_sandbox_as_killed(sandbox: Sandbox) -> None:
    result = await sandbox.run("kill -9 $PPID; sleep 5", {}, QUICK)
    assert result.finish_reason == "killed" and result.exit_code is None and result.files is None, result
    assert result.wall_s < 2.0


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the unprivileged host uid happens only as root")
async def test_as_root_the_sandbox_runs_as_the_unprivileged_host_uid(sandbox: Sandbox, token: str) -> None:
    run = asyncio.create_task(sandbox.run(f"sleep 2 # {token}", {}, QUICK))
    for _ in range(100):  # until the command runs (was a fixed 0.5 s: too short on a loaded machine)
        if pids := host_processes(token):
            break
        await asyncio.sleep(0.02)
    uids = {host_uid(pid) for pid in pids}
    await run
    assert uids == {sandbox.config.host_uid}


async def test_a_fork_bomb_in_one_sandbox_does_not_starve_another(sandbox: Sandbox) -> None:
    # `exec`: the wait after the bomb needs no fork of its own (CI once saw the shell, unable to
    # fork `sleep` while the bomb held every process slot, give up and end before the wall).
    bomb = sandbox.run("bomb() { bomb | bomb & }; bomb; exec sleep 30", {}, Limits(wall_s=3.0, processes=16))
    await asyncio.sleep(0)

    async def neighbour() -> list[str]:
        await asyncio.sleep(0.5)
        results = await asyncio.gather(
            *(sandbox.run("sh -c 'echo a' & sh -c 'echo b' & wait", {}, QUICK) for _ in range(3))
        )
        return [r.finish_reason + ":" + "".join(sorted(r.stdout.split())) for r in results]

    bombed, calm = await asyncio.gather(bomb, neighbour())
    assert bombed.finish_reason == "timeout"
    assert calm == ["ok:ab"] * 3


async def test_a_cancelled_call_kills_its_sandbox(sandbox: Sandbox, token: str) -> None:
    run = asyncio.create_task(sandbox.run(f"sleep 100 # {token}", {}, Limits(wall_s=30.0)))
    for _ in range(100):
        if host_processes(token):
            break
        await asyncio.sleep(0.05)
    assert host_processes(token), "the command never started"
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert host_processes(token) == []


async def test_killing_a_sandbox_reaches_a_child_in_another_session(token: str) -> None:
    """The sandbox's PID 1 runs in a session of its own; the kill must reach it, not only the
    group of the process it started, or it outlives the call and holds its pipes open."""
    sleeper = "import sys, time; time.sleep(300)"
    parent = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], start_new_session=True); "
        "time.sleep(300)"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", parent, sleeper, token, stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    for _ in range(100):
        if len(host_processes(token)) == 2:
            break
        await asyncio.sleep(0.05)
    assert len(host_processes(token)) == 2, "the grandchild never started"
    try:
        kill_process_tree(process.pid)
        await asyncio.wait_for(process.wait(), 5.0)  # pipes closed: nothing of the tree holds them
        assert host_processes(token) == []
    finally:
        for pid in host_processes(token):
            os.kill(pid, signal.SIGKILL)


async def test_many_sandboxes_at_once_stay_apart() -> None:
    sandbox = Sandbox(SandboxConfig(max_concurrent=4))
    results = await asyncio.gather(
        *(
            sandbox.run(
                f"cat mine; ls /work; echo {i} > /tmp/t; sleep 0.2; cat /tmp/t", {"mine": f"{i}\n"}, QUICK
            )
            for i in range(8)
        )
    )
    assert [r.stdout.split() for r in results] == [[str(i), "mine", str(i)] for i in range(8)]
    assert all(r.files == {"mine": f"{i}\n".encode()} for i, r in enumerate(results))


async def test_a_missing_bubblewrap_refuses_to_run_anything() -> None:
    sandbox = Sandbox(SandboxConfig(bwrap="/nonexistent/bwrap"))
    with pytest.raises(
        SandboxUnavailable, match=r"bubblewrap .* is not installed: apt-get install bubblewrap"
    ):
        await sandbox.run("true")


def test_check_builds_one_sandbox_or_says_why(sandbox: Sandbox) -> None:
    sandbox.check()
    with pytest.raises(
        SandboxUnavailable, match="could not build the sandbox: bwrap: Can't find source path /nope"
    ):
        Sandbox(SandboxConfig(ro_paths=("/nope",))).check()


async def test_a_sandbox_bubblewrap_cannot_build_is_reported_not_run(sandbox: Sandbox) -> None:
    broken = Sandbox(SandboxConfig(ro_paths=("/nonexistent-path-for-the-test",)))
    with pytest.raises(
        SandboxUnavailable, match="bubblewrap could not build the sandbox: bwrap: Can't find source path"
    ):
        await broken.run("true")
