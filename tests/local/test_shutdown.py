"""Stopping `mixrl run`'s processes, with small shell processes standing in for the components:
every process of a component's group goes (SIGTERM, then SIGKILL to the group), and a second SIGTERM
or a failing stop during the shutdown leaves no component running."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from mixrl.api.loader import load_rlrun, parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import resolve
from mixrl.local import run as run_module
from mixrl.local.processes import Process, wait_healthy
from mixrl.local.run import Progress, Supervisor, supervise
from tests.fakes import HandledInAFinalizer

ROOT = Path(__file__).resolve().parents[2]


def running(pid: int, within: float = 5.0) -> bool:
    """Whether ``pid`` still runs ``within`` seconds from now (SIGKILL takes effect when the process
    is next scheduled, not when kill() returns); a zombie left to an init that does not reap it does
    not run."""
    deadline = time.monotonic() + within
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.02)


def component(tmp_path: Path, name: str, on_term: str) -> tuple[Process, Path]:
    """A component that runs ``on_term`` on SIGTERM, with a child of its own (as torchrun's ranks),
    whose pid it writes to the returned file."""
    pid_file = tmp_path / f"{name}.child"
    script = f"trap '{on_term}' TERM; sleep 300 & echo $! > {pid_file}; wait; wait"
    return Process(name, ["sh", "-c", script], tmp_path / "logs" / f"{name}.log"), pid_file


def child_of(pid_file: Path) -> int:
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, f"{pid_file} was never written"
        time.sleep(0.02)
    return int(pid_file.read_text())


def test_the_sigkill_fallback_reaches_the_components_own_children(tmp_path: Path) -> None:
    # The component and its child ignore SIGTERM (the child inherits the ignored signal).
    process, pid_file = component(tmp_path, "trainer", "")
    process.start()
    child = child_of(pid_file)
    assert process.stop(timeout=0.5) == -signal.SIGKILL
    assert not running(child)


def test_children_that_outlive_their_component_are_stopped_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    # The component exits on SIGTERM at once; its child ignores SIGTERM and would run on.
    script = f"trap 'exit 0' TERM; (trap '' TERM; exec sleep 300) & echo $! > {pid_file}; wait"
    process = Process("rollout", ["sh", "-c", script], tmp_path / "rollout.log")
    process.start()
    child = child_of(pid_file)
    assert process.stop(timeout=10) == 0
    assert not running(child)


class SignalledWhileStopping(Process):
    """A component during whose stop the supervisor gets SIGTERM again (a service manager repeats
    it, an impatient user sends a second `kill`)."""

    def stop(self, timeout: float = 15.0) -> int | None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs here
        return super().stop(timeout)


class FailsToStop(Process):
    def stop(self, timeout: float = 15.0) -> int | None:
        super().stop(timeout)
        raise RuntimeError("the stop went wrong")


class TwoComponents(Supervisor):
    """A router and a buffer (each stops a second after SIGTERM), then SIGTERM to the supervisor."""

    def __init__(self, tmp_path: Path, router: type[Process]) -> None:
        run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
        super().__init__(run, tmp_path, "/model", "/tokenizer.json")
        self.children: list[int] = []
        self.router_class = router

    def start(
        self, initial_version_path: str, initial_version: int, check_signals: Callable[[], None]
    ) -> None:
        for name, kind in (("router", self.router_class), ("buffer", Process)):
            stand_in, pid_file = component(self.run_dir, name, "sleep 1; exit 0")
            process = kind(stand_in.name, stand_in.command, stand_in.log_path)
            self.components.append(process)
            process.start()
            self.children.append(child_of(pid_file))
        self.trainer = self.components[0]
        os.kill(os.getpid(), signal.SIGTERM)  # the first SIGTERM: stop the run
        time.sleep(30)  # (interrupted by it)
        raise AssertionError("SIGTERM did not stop the run")


@pytest.mark.parametrize(
    "router", [SignalledWhileStopping, FailsToStop], ids=["second-sigterm", "stop-raises"]
)
def test_no_component_survives_a_second_sigterm_or_a_failed_stop(
    tmp_path: Path, router: type[Process], capsys: pytest.CaptureFixture[str]
) -> None:
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    supervisor = TwoComponents(tmp_path, router)
    status = supervise(supervisor, Progress(tmp_path, None), "/v0", 0)
    assert status == 130
    for process in supervisor.components:  # the router first, then the buffer: both stopped
        assert process.process is not None and process.returncode is not None, process.name
    assert not any(running(child) for child in supervisor.children)
    output = capsys.readouterr()
    assert "mixrl run: interrupted; stopping components" in output.out
    if router is FailsToStop:
        assert output.err.strip() == "mixrl run: stopping router failed: RuntimeError('the stop went wrong')"
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # put back


class SignalledWhileTraining(Supervisor):
    """A trainer and a buffer that run until stopped; SIGTERM to the supervisor a moment after they
    started, while it watches them."""

    def __init__(self, tmp_path: Path) -> None:
        run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
        super().__init__(run, tmp_path, "/model", "/tokenizer.json")

    def start(
        self, initial_version_path: str, initial_version: int, check_signals: Callable[[], None]
    ) -> None:
        for name in ("trainer", "buffer"):
            stand_in, _ = component(self.run_dir, name, "exit 0")
            self.components.append(stand_in)
            stand_in.start()
        self.trainer = self.components[0]
        main = threading.main_thread().ident or 0
        threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGTERM)).start()


class SignalledWhileStarting(SignalledWhileTraining):
    """As :class:`SignalledWhileTraining`, but the SIGTERM comes while the supervisor waits for the
    buffer's health (its port is never written: it would wait out the 300 s)."""

    def start(
        self, initial_version_path: str, initial_version: int, check_signals: Callable[[], None]
    ) -> None:
        super().start(initial_version_path, initial_version, check_signals)
        never_healthy = replace(self.components[1], port_file=self.run_dir / "buffer.port")
        wait_healthy([never_healthy], timeout=300, between_polls=check_signals)


@pytest.mark.parametrize(
    "supervisor_class", [SignalledWhileTraining, SignalledWhileStarting], ids=["training", "starting"]
)
def test_a_signal_whose_raise_was_lost_still_stops_the_run(
    tmp_path: Path, supervisor_class: type[SignalledWhileTraining], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_module, "StopSignals", HandledInAFinalizer)
    supervisor, dropped = supervisor_class(tmp_path), []
    hook, sys.unraisablehook = sys.unraisablehook, dropped.append
    try:
        began = time.monotonic()
        assert supervise(supervisor, Progress(tmp_path, None), "/v0", 0) == 130
        took = time.monotonic() - began
    finally:
        sys.unraisablehook = hook
    assert [drop.exc_type for drop in dropped] == [run_module.Interrupted]  # the raise was lost
    assert took < 30  # the components run 300 s unless stopped
    assert all(process.returncode == 0 for process in supervisor.components)  # stopped by SIGTERM


class RecordsItsStop(Process):
    def stop(self, timeout: float = 15.0) -> int | None:
        self.timeout = timeout
        return super().stop(timeout)


def test_the_trainer_gets_its_stop_grace_and_the_others_the_default(tmp_path: Path) -> None:
    """The trainer ends its step and saves a checkpoint when stopped: it has the spec's
    ``trainer.stopGraceSeconds`` before SIGKILL, as its pods have in a cluster."""
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["trainer"]["stopGraceSeconds"] = 45
    run = parse_document(doc)
    assert isinstance(run, RLRun)
    supervisor = Supervisor(resolve(run), tmp_path, "/model", "/tokenizer.json")
    supervisor.components = [
        RecordsItsStop(name, ["true"], tmp_path / f"{name}.log") for name in ("buffer", "trainer")
    ]
    supervisor.stop()
    assert {p.name: getattr(p, "timeout", None) for p in supervisor.components} == {
        "buffer": 15.0,
        "trainer": 45,
    }
