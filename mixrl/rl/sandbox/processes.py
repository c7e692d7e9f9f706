"""Ending every process a sandboxed command started, including those that left its group.

A command can start a process in a session of its own (``setsid``, ``start_new_session``); a kill
of the command's process group misses it, and it keeps the command's pipes open, so a wait for the
command's end would last as long as it does.  These helpers find processes by their parent links
in ``/proc`` instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Mapping

PR_SET_CHILD_SUBREAPER = 36
"""prctl(2): orphaned descendants are reparented to this process instead of to PID 1."""
KILL_ROUNDS = 50
"""Walks of the process table at most, each killing what it found; a process forked during one
walk is found by the next (fork bombs are bounded by RLIMIT_NPROC)."""


def descendants(pid: int, parents: Mapping[int, int]) -> list[int]:
    """Every process below ``pid`` in a ``{pid: parent pid}`` table, nearest first."""
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    frontier = [pid]
    while frontier:
        below = [child for parent in frontier for child in children.get(parent, [])]
        found += below
        frontier = below
    return found


def process_table() -> dict[int, tuple[int, str]]:
    """``{pid: (parent pid, state)}`` of the processes this one can see, read from /proc."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                # "pid (comm) state ppid …": comm may hold spaces and parentheses
                fields = stat.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 1:
            table[int(entry.name)] = (int(fields[1]), fields[0].decode())
    return table


def living_parents() -> dict[int, int]:
    """``{pid: parent pid}`` of the processes that have not ended (a zombie holds nothing open and
    starts nothing)."""
    return {pid: parent for pid, (parent, state) in process_table().items() if state != "Z"}


def kill_process_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process descended from ``pid``.

    The group is stopped first so that it cannot start a child between the walk and the kill.
    bubblewrap's child, the sandbox's PID 1, runs in a session of its own (``--new-session``), so
    the group alone misses it, and ``--die-with-parent`` is no guarantee: one was seen to outlive a
    killed bubblewrap, holding the call's pipes open.  Killing a PID namespace's PID 1 ends the
    whole namespace, so what the sandbox starts meanwhile dies with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGSTOP)
    for descendant in descendants(pid, living_parents()):
        _kill(descendant)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def kill_descendants_of_self(keep_waited: int) -> None:
    """SIGKILL every process below this one, walking again until none is left, and reap the
    orphans that were reparented here (``keep_waited``, the child asyncio waits for, is left to it).
    Only for a process whose children are all the command's (the sandbox pod's executor)."""
    me = os.getpid()
    killed: set[int] = set()
    for _ in range(KILL_ROUNDS):
        found = descendants(me, living_parents())
        if not found:
            break
        for pid in found:
            _kill(pid)
        killed.update(found)
    for pid, (parent, state) in process_table().items():
        if parent == me and pid != keep_waited and (pid in killed or state == "Z"):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # SIGKILLed or ended: returns at once


def become_subreaper() -> bool:
    """Make this process the one orphaned descendants are reparented to (Linux); False where the
    kernel refuses (a pod's PID 1 is their parent anyway)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
