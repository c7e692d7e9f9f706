"""The sandbox's pure parts: limits, paths, the archive reader, the finish-reason rules, the command line."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import pytest

from mixrl.rl.sandbox import Limits, SandboxConfig
from mixrl.rl.sandbox.command import bwrap_argv
from mixrl.rl.sandbox.files import check_path, read_tar, write_tree
from mixrl.rl.sandbox.limits import prlimit_args
from mixrl.rl.sandbox.processes import descendants
from mixrl.rl.sandbox.runner import classify


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("wall_s", 0, "limits.wall_s: must be positive and at most 2**62, got 0"),
        (
            "file_bytes",
            2**63,
            "limits.file_bytes: must be positive and at most 2**62, got 9223372036854775808",
        ),
        ("cpu_s", 1.5, "limits.cpu_s: must be a whole number, got 1.5"),
        ("memory_bytes", True, "limits.memory_bytes: must be a number, got True"),
        ("processes", 2, "limits.processes: must be at least 4"),
    ],
)
def test_bad_limits_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Limits(**{field: value})  # type: ignore[arg-type]


def test_prlimit_arguments_carry_every_limit() -> None:
    args = prlimit_args(Limits(cpu_s=3, memory_bytes=100, processes=9, file_bytes=7, open_files=5))
    assert args == ["--cpu=3:4", "--as=100", "--nproc=9", "--fsize=7", "--nofile=5", "--core=0"]


@pytest.mark.parametrize(
    ("path", "normalized"), [("a.py", "a.py"), ("./pkg//mod.py", "pkg/mod.py"), ("d/./e/f", "d/e/f")]
)
def test_relative_paths_are_normalized(path: str, normalized: str) -> None:
    assert check_path(path) == normalized


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/etc/passwd", "absolute"),
        ("../x", "climbs out"),
        ("a/../../x", "climbs out"),
        ("", "non-empty"),
        (".", "working directory itself"),
        ("a\x00b", "NUL"),
        ("a\\b", "backslash"),
    ],
)
def test_paths_that_leave_the_working_directory_are_refused(path: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        check_path(path)


def test_write_tree_refuses_a_file_that_is_also_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'a' is both a file and the directory of 'a/b'"):
        write_tree(str(tmp_path), {"a": "x", "a/b": "y"})
    assert list(tmp_path.iterdir()) == []


def forged_archive() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in [
            ("./ok.txt", b"fine"),
            ("../../etc/evil", b"x"),
            ("/abs", b"y"),
            ("./d/e.py", b"z"),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("./link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/shadow"
        archive.addfile(link)
    return buffer.getvalue()


def test_a_forged_archive_becomes_only_safe_entries() -> None:
    files, dropped = read_tar(forged_archive(), max_files=10)
    assert files == {"ok.txt": b"fine", "d/e.py": b"z"}
    assert len(dropped) == 3
    assert dropped[0].endswith("climbs out with '..'")
    assert dropped[1].endswith("is absolute; paths are relative to the working directory")
    assert dropped[2] == "'./link': not a regular file"


def test_files_past_the_cap_are_dropped_with_a_note() -> None:
    files, dropped = read_tar(forged_archive(), max_files=1)
    assert files == {"ok.txt": b"fine"} and "'d/e.py': more than 1 files" in dropped


@pytest.mark.parametrize(
    ("status", "stderr", "reason"),
    [
        (0, "", "ok"),
        (1, "AssertionError", "ok"),
        (152, "", "timeout"),
        (153, "", "disk"),
        (1, "MemoryError", "memory"),
        (0, "MemoryError printed by a passing test", "ok"),
        (1, "OSError: [Errno 28] No space left on device", "disk"),
        (137, "", "killed"),
    ],
)
def test_finish_reasons(status: int, stderr: str, reason: str) -> None:
    assert classify(status, stderr, Limits())[0] == reason


def test_the_command_line_isolates_everything_it_promises() -> None:
    argv = bwrap_argv(SandboxConfig(ro_paths=("/opt/py",)), Limits(disk_bytes=123), "/tmp/seed", "echo hi")
    for option in (
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ):
        assert option in argv
    assert "--share-net" not in argv and "--bind" not in argv and "--dev-bind" not in argv
    pairs = list(zip(argv, argv[1:], argv[2:], strict=False))
    assert ("--ro-bind", "/tmp/seed", "/seed") in pairs and ("--ro-bind", "/opt/py", "/opt/py") in pairs
    assert ("--size", "123", "--tmpfs") in pairs and argv.count("--tmpfs") == 2
    assert argv[argv.index("mixrl-sandbox") + 1] == "echo hi"


def test_config_refuses_to_mount_over_the_sandboxes_own_places() -> None:
    with pytest.raises(ValueError, match=r"sandbox\.ro_paths: '/work' must be an absolute path other than"):
        SandboxConfig(ro_paths=("/work",))


def test_descendants_are_every_process_below_nearest_first() -> None:
    parents = {10: 1, 11: 10, 12: 10, 13: 11, 14: 13, 20: 1, 21: 20}
    assert descendants(10, parents) == [11, 12, 13, 14]
    assert descendants(14, parents) == []
    assert descendants(99, parents) == []
