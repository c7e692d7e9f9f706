"""The bubblewrap command line of one sandboxed run (pure).

Inside, the command sees:

- ``/usr`` (and the ``/bin``, ``/lib``, ``/lib64``, ``/sbin`` links into it), a few harmless files
  of ``/etc`` and the config's extra read-only paths, all read-only;
- ``/work``: its working directory, a fresh tmpfs of ``limits.disk_bytes`` holding a copy of the
  files it was given (read-only at ``/seed``), and ``/tmp``, another such tmpfs: the only places it
  can write;
- a new ``/proc`` of its own PID namespace, a minimal ``/dev``;
- no network (an empty network namespace: only a down loopback), no host processes, no IPC,
  its own hostname;
- uid/gid 1000 in a user namespace of its own with no capabilities, no further user namespaces
  (``--disable-userns``), ``no_new_privs`` set.

The wrapper shell that runs inside copies the files in, runs the command under ``prlimit``, then
writes the command's exit status and a tar of ``/work`` to the results pipe.  That pipe arrives as
the wrapper's stdin (fd 0, opened for writing): dash, the shell it uses, cannot name a
descriptor above 9, and the command never reads stdin anyway (it gets ``/dev/null``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mixrl.rl.sandbox.limits import Limits, prlimit_args

SEED_DIR = "/seed"
WORK_DIR = "/work"
EXTRA_BIN = "/opt/mixrl/bin"
SANDBOX_UID = 1000
SANDBOX_GID = 1000
ETC_FILES = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/localtime")
"""The only parts of the host's /etc the sandbox sees: what programs in /usr need to start
(Debian's alternatives links, the dynamic loader's cache, the time zone), nothing that names users,
hosts or credentials."""

STARTED = b"mixrl-sandbox started\n"
"""The wrapper's first line on the results pipe: the sandbox was built (bubblewrap's own failures
come before it), so whatever happens next is the command's doing."""
COPY_FAILED = 125
"""The wrapper's exit status when the files did not fit into /work."""

WRAPPER = rf"""
exec 3>&0 </dev/null
printf '{STARTED.decode().strip()}\n' >&3
command="$1"
shift
cp -R /seed/. /work/ || {{ echo "mixrl sandbox: the files did not fit into /work" >&2; exit {COPY_FAILED}; }}
prlimit "$@" -- /bin/sh -c "$command" 3>&-
status=$?
printf 'status %s\n' "$status" >&3
tar -C /work -cf - . >&3 2>/dev/null
exit "$status"
""".strip()


@dataclass(frozen=True)
class SandboxConfig:
    """How sandboxes are built on this host (the same for every command)."""

    bwrap: str = "bwrap"
    """The bubblewrap program (Debian's ``bubblewrap`` package)."""
    host_uid: int = 65534
    """When mixrl runs as root: the host uid (and gid) bubblewrap is started as, so that a process
    that left the sandbox would be ``nobody``, not root.  Ignored otherwise (it runs as you)."""
    ro_paths: tuple[str, ...] = ()
    """Extra host paths mounted read-only at the same place (an interpreter outside /usr)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables of the command (the environment is otherwise cleared)."""
    max_concurrent: int = 8
    """Sandboxes running at once in this process; more calls wait their turn."""
    max_files: int = 2000
    """Files read back from ``/work`` after a run; past it the rest are dropped with a note."""
    base_env: tuple[tuple[str, str], ...] = field(
        default=(
            ("PATH", f"{EXTRA_BIN}:/usr/local/bin:/usr/bin:/bin"),
            ("HOME", WORK_DIR),
            ("TMPDIR", "/tmp"),
            ("LANG", "C.UTF-8"),
            ("PYTHONDONTWRITEBYTECODE", "1"),
            ("PYTHONUNBUFFERED", "1"),
        ),
        repr=False,
    )

    def __post_init__(self) -> None:
        if self.max_concurrent <= 0:
            raise ValueError(f"sandbox.max_concurrent: must be positive, got {self.max_concurrent}")
        if self.max_files <= 0:
            raise ValueError(f"sandbox.max_files: must be positive, got {self.max_files}")
        for path in self.ro_paths:
            if not path.startswith("/") or path.rstrip("/") in (
                "",
                WORK_DIR,
                SEED_DIR,
                "/tmp",
                "/proc",
                "/dev",
            ):
                raise ValueError(
                    f"sandbox.ro_paths: {path!r} must be an absolute path other than /, /work, /seed, /tmp, /proc, /dev"
                )


def bwrap_argv(config: SandboxConfig, limits: Limits, seed_dir: str, command: str) -> list[str]:
    """The whole command line: bubblewrap's options, then the wrapper with ``prlimit``'s options."""
    argv = [
        config.bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_GID),
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for name in ("bin", "lib", "lib64", "sbin"):
        argv += ["--symlink", f"usr/{name}", f"/{name}"]
    for path in ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    for path in config.ro_paths:
        argv += ["--ro-bind", path, path]
    # `python` is python3, as Debian's python-is-python3 makes it: what models (and people) type
    argv += ["--dir", EXTRA_BIN, "--symlink", "/usr/bin/python3", f"{EXTRA_BIN}/python"]
    # /dev is a tmpfs of half the host's memory: read-only, it holds only its device nodes (writes
    # to /dev/null still work), so /work and /tmp, each within disk_bytes, are the only writable places.
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    argv += ["--size", str(limits.disk_bytes), "--tmpfs", WORK_DIR]
    argv += ["--size", str(limits.disk_bytes), "--tmpfs", "/tmp"]
    argv += ["--ro-bind", seed_dir, SEED_DIR, "--remount-ro", "/", "--chdir", WORK_DIR]
    for name, value in (*config.base_env, *config.env):
        argv += ["--setenv", name, value]
    return [*argv, "/bin/sh", "-c", WRAPPER, "mixrl-sandbox", command, *prlimit_args(limits)]
