"""What one sandboxed command may use, and how the limits become ``prlimit`` arguments (pure).

Every limit is enforced by the kernel, not by watching: the rlimits through ``prlimit`` inside the
sandbox, the disk through the size of the two tmpfs mounts (``/work`` and ``/tmp``), the wall clock
and the output caps by the runner killing the whole sandbox.  See docs/sandbox.md#limits.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MiB = 1024 * 1024
LARGEST = 2**62
"""The largest limit taken: rlimits are 64-bit, and a wall clock beyond it is no limit at all."""


@dataclass(frozen=True)
class Limits:
    """Per-command limits.  Memory, processes, file size and open files are rlimits: per process
    (``memory_bytes``, ``file_bytes``, ``open_files``) or per sandbox user (``processes``)."""

    wall_s: float = 10.0
    """Wall-clock limit of the whole run (copying the files in and out included); then SIGKILL."""
    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL one second later."""
    memory_bytes: int = 512 * MiB
    """Address space per process (RLIMIT_AS): an allocation past it fails (MemoryError in Python)."""
    processes: int = 32
    """Processes and threads of the sandbox's user (RLIMIT_NPROC, counted inside its own user
    namespace, so sandboxes running at once do not share it); fork fails past it."""
    file_bytes: int = 16 * MiB
    """Largest file a process may write (RLIMIT_FSIZE): SIGXFSZ past it."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    disk_bytes: int = 64 * MiB
    """Size of each of the two writable tmpfs mounts, ``/work`` and ``/tmp``: ENOSPC past it."""
    output_bytes: int = 64 * 1024
    """Bytes kept of stdout and of stderr each; past either the sandbox is killed (``output_limit``)."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"limits.{field.name}: must be a number, got {value!r}")
            if field.type == "int" and not isinstance(value, int):
                raise ValueError(f"limits.{field.name}: must be a whole number, got {value!r}")
            if not 0 < value <= LARGEST:  # NaN fails this too
                raise ValueError(f"limits.{field.name}: must be positive and at most 2**62, got {value!r}")
        if self.processes < 4:
            raise ValueError(
                f"limits.processes: must be at least 4 (the sandbox's init, its wrapper shell, "
                f"prlimit and the command count), got {self.processes}"
            )


def prlimit_args(limits: Limits) -> list[str]:
    """``prlimit`` options that apply ``limits`` to the command (soft:hard; no core dumps)."""
    return [
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
        f"--as={limits.memory_bytes}",
        f"--nproc={limits.processes}",
        f"--fsize={limits.file_bytes}",
        f"--nofile={limits.open_files}",
        "--core=0",
    ]
