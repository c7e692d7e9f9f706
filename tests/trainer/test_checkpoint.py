"""Sharded checkpoints (torch.distributed.checkpoint): written by each rank for its own shards,
resumed on another number of ranks exactly where an uninterrupted run would be, committed
atomically, and loaded without running a pickle from the files.

The ranks are real torchrun processes over gloo (``fsdp_worker.py``); the uninterrupted run they
are compared with is one process, computed in the same test.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from mixrl.api.trajectory import Trajectory
from mixrl.rl.tiny_models import create_tiny_checkpoint
from mixrl.rl.trainer import checkpoint
from mixrl.rl.trainer.batch import PolicyBatch, collate
from mixrl.rl.trainer.checkpoint import CheckpointError
from mixrl.rl.trainer.torch_backend import TorchPolicyTrainer

from .conftest import reference_trainer, torchrun
from .fsdp_worker import optimizer_tensors

State = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
"""The published weights (FP32) and AdamW's whole state, as the worker writes them."""


def batch_of(groups_json: Path) -> PolicyBatch:
    raw = json.loads(groups_json.read_text())
    return collate([[Trajectory.model_validate(t) for t in g] for g in raw], trainer_version=0)


def state_of(trainer: TorchPolicyTrainer) -> State:
    return trainer.state_dict_for_publication(torch.float32), optimizer_tensors(trainer)


def uninterrupted(model_dir: Path, groups_json: Path, steps: int) -> list[State]:
    """The state after each of ``steps`` steps of one process that never stops."""
    trainer = reference_trainer(model_dir)
    batch = batch_of(groups_json)
    states = []
    for _ in range(steps):
        trainer.step(batch)
        states.append(state_of(trainer))
    return states


def written(out: Path) -> State:
    return load_file(str(out / "weights.safetensors")), load_file(str(out / "optimizer.safetensors"))


def assert_same_state(got: State, want: State, label: str = "") -> None:
    """Equal within FP32 reduction-order noise.  The update's sums run in another order on two
    ranks, and AdamW, dividing by √v, turns that noise into ~1e-5 on an element whose gradient is
    near zero, hence 5e-5 on the weights (5% of one step's largest move at lr 1e-3).  A resume
    that lost AdamW's state moves the weights by a median 5e-4 here (94% of them past 5e-5), and
    its moments are compared to 1e-4 of their scale."""
    (weights, optimizer), (want_weights, want_optimizer) = got, want
    assert weights.keys() == want_weights.keys() and optimizer.keys() == want_optimizer.keys()
    for name, value in want_weights.items():
        torch.testing.assert_close(
            weights[name], value, rtol=1e-4, atol=5e-5, msg=lambda m, name=name: f"{label} {name}: {m}"
        )
    for name, value in want_optimizer.items():
        if name.endswith("/step"):
            assert float(optimizer[name]) == float(value), name
        else:  # the moments' scales differ by orders of magnitude (AdamW's second moment is ~g²)
            atol = 1e-4 * float(value.abs().max())
            torch.testing.assert_close(
                optimizer[name], value, rtol=1e-3, atol=atol, msg=lambda m, name=name: f"{label} {name}: {m}"
            )


def test_a_checkpoint_resumes_on_another_number_of_ranks_where_the_run_would_be(
    tmp_path: Path, tiny_model_dir: Path, groups_json: Path
) -> None:
    _, after2, after3 = uninterrupted(tiny_model_dir, groups_json, steps=3)
    saved: dict[int, Path] = {}
    for ranks in (2, 1):  # two steps, then a checkpoint, on two ranks and on one
        out = tmp_path / f"saved-on-{ranks}"
        out.mkdir()
        torchrun(ranks, tiny_model_dir, groups_json, out, 2, "--save", out / "run", cwd=out)
        assert_same_state(written(out), after2, f"saved on {ranks}")
        saved[ranks] = out / "run" / "checkpoint-2"
        assert checkpoint.latest(out / "run") == saved[ranks]
    for saved_on, resumed_on in ((2, 1), (2, 2), (1, 2)):
        out = tmp_path / f"from-{saved_on}-on-{resumed_on}"
        out.mkdir()
        torchrun(resumed_on, tiny_model_dir, groups_json, out, 1, "--load", saved[saved_on], cwd=out)
        assert json.loads((out / "step.json").read_text()) == 3
        assert_same_state(written(out), after3, out.name)  # 2 steps + resume + 1 step = 3 uninterrupted steps


def test_each_rank_writes_only_its_own_shards(
    tmp_path: Path, tiny_model_dir: Path, groups_json: Path
) -> None:
    sizes: dict[int, dict[str, int]] = {}
    for ranks in (1, 2):
        out = tmp_path / str(ranks)
        out.mkdir()
        torchrun(ranks, tiny_model_dir, groups_json, out, 1, "--save", out / "run", cwd=out)
        directory = out / "run" / "checkpoint-1"
        sizes[ranks] = {path.name: path.stat().st_size for path in directory.iterdir()}
    assert set(sizes[1]) == {".metadata", "__0_0.distcp"}
    assert set(sizes[2]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    whole, halves = sizes[1]["__0_0.distcp"], (sizes[2]["__0_0.distcp"], sizes[2]["__1_0.distcp"])
    # Each rank's file holds about half of the state, and together they hold it once.
    assert all(0.35 * whole < half < 0.65 * whole for half in halves), (whole, halves)
    assert 0.95 * whole < sum(halves) < 1.2 * whole, (whole, halves)
    # Every sharded tensor: rank 0's rows in rank 0's file, rank 1's rows in rank 1's.
    metadata = checkpoint.read_metadata(tmp_path / "2" / "run" / "checkpoint-1")
    files_of: dict[str, dict[int, str]] = {}
    for index, info in metadata.storage_data.items():
        files_of.setdefault(index.fqn, {})[int(index.offset[0]) if index.offset else 0] = info.relative_path
    sharded = {fqn: files for fqn, files in files_of.items() if len(files) == 2}
    assert any(fqn.startswith("model.") for fqn in sharded) and any("exp_avg_sq" in f for f in sharded)
    for fqn, files in sharded.items():
        assert [files[offset] for offset in sorted(files)] == ["__0_0.distcp", "__1_0.distcp"], fqn


def test_a_crash_mid_save_leaves_the_previous_checkpoint(
    tmp_path: Path, tiny_model_dir: Path, groups_json: Path
) -> None:
    _, after2 = uninterrupted(tiny_model_dir, groups_json, steps=2)
    run = tmp_path / "run"
    crashed = torchrun(
        2, tiny_model_dir, groups_json, tmp_path, 2, "--save", run, "--save-every", 1, "--kill-in-save", 2,
        cwd=tmp_path, check=False,
    )  # fmt: skip
    assert crashed.returncode != 0, "rank 0 was to be killed inside the save of step 2"
    # DCP had written every shard of step 2 and its metadata; the commit (the rename) never came.
    assert (run / "checkpoint.tmp-2" / ".metadata").is_file()
    assert not (run / "checkpoint-2").exists()
    assert checkpoint.latest(run) == run / "checkpoint-1"
    out = tmp_path / "resumed"
    out.mkdir()
    torchrun(2, tiny_model_dir, groups_json, out, 1, "--load", run / "checkpoint-1", "--save", run, cwd=out)
    assert_same_state(written(out), after2)
    assert sorted(path.name for path in run.iterdir()) == ["checkpoint-2"]  # the leftovers removed


@pytest.fixture
def trainer(tiny_model_dir: Path, groups_json: Path) -> TorchPolicyTrainer:
    """The reference trainer one step in, so that a checkpoint holds optimizer state."""
    trainer = reference_trainer(tiny_model_dir)
    trainer.step(batch_of(groups_json))
    return trainer


def test_ranks_that_do_not_share_the_run_directory_are_told_so(
    tmp_path: Path, tiny_model_dir: Path, groups_json: Path, trainer: TorchPolicyTrainer
) -> None:
    """Each rank on its own directory (nodes with a volume each): a save is refused before its
    commit, and so is a resume where the ranks find different checkpoints."""
    run = tmp_path / "run"
    (run / "rank1").mkdir(parents=True)
    trainer.save_checkpoint(run / "rank0", step=1)  # rank 0 sees a checkpoint, rank 1 none
    args = (tiny_model_dir, groups_json, tmp_path, 1, "--dir-per-rank")
    resumed = torchrun(2, *args, "--resume", run, cwd=tmp_path, check=False)
    assert resumed.returncode != 0
    assert "the trainer's ranks see different checkpoints" in resumed.stdout + resumed.stderr
    saved = torchrun(2, *args, "--save", tmp_path / "other", cwd=tmp_path, check=False)
    assert saved.returncode != 0
    assert "rank 0 does not see __1_0.distcp that other ranks wrote" in saved.stdout + saved.stderr
    assert checkpoint.latest(tmp_path / "other" / "rank0") is None  # nothing committed


class RunsCode:
    """A pickle that runs ``touch MARKER`` when unpickled (what a hostile run volume could hold)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


def test_metadata_naming_a_forbidden_global_is_refused_without_running_it(
    tmp_path: Path, trainer: TorchPolicyTrainer
) -> None:
    path = trainer.save_checkpoint(tmp_path, step=1)
    metadata = checkpoint.read_metadata(path)
    marker = tmp_path / "ran"
    metadata.version = RunsCode(marker)  # type: ignore[assignment]
    hostile = pickle.dumps(metadata)
    (path / ".metadata").write_bytes(hostile)
    before = state_of(trainer)
    with pytest.raises(
        CheckpointError, match=r"\.metadata: refused: (posix|os|nt)\.system is not a DCP metadata type"
    ):
        trainer.load_checkpoint(path)
    assert not marker.exists()
    assert_same_state(state_of(trainer), before)  # refused before anything was loaded
    pickle.loads(hostile)  # what DCP's own reader (pickle.load) would have done
    assert marker.exists(), "the crafted metadata does run code when unpickled"


def test_a_non_tensor_value_that_pickles_code_is_refused_without_running_it(
    tmp_path: Path, trainer: TorchPolicyTrainer
) -> None:
    marker = tmp_path / "ran"
    # A checkpoint whose step (a non-tensor value, stored as torch.save bytes) pickles code.
    state = trainer._sharded_state() | {"step": RunsCode(marker)}
    path = checkpoint.save(tmp_path, 1, state, is_main=True)
    with pytest.raises(
        CheckpointError, match=r"step: refused \(weights_only\): .*GLOBAL (posix|os|nt)\.system"
    ):
        trainer.load_checkpoint(path)
    assert not marker.exists()
    plain = trainer._sharded_state() | {"step": 0}
    with warnings.catch_warnings():  # DCP warns that it loads in one process: meant
        warnings.simplefilter("ignore")
        dcp.load(plain, checkpoint_id=path)  # DCP's default planner: torch.load(weights_only=False)
    assert marker.exists(), "the crafted value does run code under DCP's default loader"


def test_metadata_naming_files_outside_the_checkpoint_is_refused(
    tmp_path: Path, trainer: TorchPolicyTrainer
) -> None:
    path = trainer.save_checkpoint(tmp_path, step=1)
    metadata = checkpoint.read_metadata(path)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = "../../elsewhere.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"'\.\./\.\./elsewhere\.distcp' is not a shard file"):
        trainer.load_checkpoint(path)


def test_a_checkpoint_of_another_model_is_refused_in_one_line(
    tmp_path: Path, tiny_model_dir: Path, groups_json: Path
) -> None:
    other = create_tiny_checkpoint(tmp_path / "wider", "qwen3", vocab_size=64, seed=3)
    path = reference_trainer(Path(other)).save_checkpoint(tmp_path / "run", step=1)
    with pytest.raises(CheckpointError) as refused:
        reference_trainer(tiny_model_dir).load_checkpoint(path)
    assert "\n" not in str(refused.value)
    assert re.search(
        r"checkpoint-1: not loaded: rank 0: ValueError: Size mismatch .*embed_tokens", str(refused.value)
    )


def test_a_single_file_checkpoint_from_before_dcp_still_loads_and_is_replaced(
    tmp_path: Path, tiny_model_dir: Path, groups_json: Path
) -> None:
    batch = batch_of(groups_json)
    run = tmp_path / "run"
    run.mkdir()
    old = reference_trainer(tiny_model_dir)
    old.step(batch)
    # What save_checkpoint wrote before sharded checkpoints: the whole state in trainer.pt.
    torch.save({"step": 1, **old._full_state(with_optimizer=True)}, run / checkpoint.LEGACY)
    assert checkpoint.latest(run) == run / checkpoint.LEGACY
    new = reference_trainer(tiny_model_dir)
    assert new.load_checkpoint(run / checkpoint.LEGACY) == 1
    assert_same_state(state_of(new), state_of(old))
    new.step(batch)
    new.save_checkpoint(run, step=2)
    assert sorted(path.name for path in run.iterdir()) == ["checkpoint-2"]


class PickledByName:
    """Pickles as ``getattr(owner, name)``: how Debian's Python 3.11.2 (the images' base) pickles
    an enum member, where 3.11.7 writes ``cls(value)``."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return getattr, (self.owner, self.name)


def test_metadata_enum_members_pickled_by_name_load_and_nothing_else_does() -> None:
    from torch.distributed.checkpoint import metadata as dcp_metadata

    def load(value: Any) -> Any:
        return checkpoint.MetadataUnpickler(io.BytesIO(pickle.dumps(value))).load()

    member = next(iter(dcp_metadata._MEM_FORMAT_ENCODING))
    assert load(PickledByName(dcp_metadata._MEM_FORMAT_ENCODING, member.name)) is member
    import subprocess

    refused = ((subprocess.Popen, "kill"), (Path, "home"), (dcp_metadata._MEM_FORMAT_ENCODING, "__class__"))
    for owner, name in refused:  # not an enum, not an allowed one, not a member
        with pytest.raises(pickle.UnpicklingError, match="not a DCP metadata"):
            load(PickledByName(owner, name))
