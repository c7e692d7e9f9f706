"""``mixrl validate`` resolves the spec's environment (a real process, the user's package on its
PYTHONPATH), and the Gymnasium adapter of examples/environments plays real episodes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.api.resolve import SamplingParams
from mixrl.rl.environments.registry import check_rollout, load_environment
from mixrl.rl.rollout.agent import run_episode
from mixrl.rl.rollout.tokenizer import Tokenizer

from .conftest import USER_ENVIRONMENT, ScriptedReplies, write_user_package, write_words

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "environments"


def spec_with(tmp_path: Path, name: str, rollout: dict[str, Any]) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["rollout"] = rollout
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def validate(*args: str | Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "validate", *map(str, args)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip


def test_validate_imports_the_users_environment_and_checks_its_tools(tmp_path: Path) -> None:
    site = write_user_package(tmp_path / "site")
    files = {"train": "/data/in/the/image/train.jsonl", "heldout": "/data/heldout.parquet"}
    good = spec_with(tmp_path, "good", {"environment": USER_ENVIRONMENT, "dataset": files, "tools": ["say"]})
    bad_tool = spec_with(
        tmp_path, "tool", {"environment": USER_ENVIRONMENT, "dataset": files, "tools": ["bash"]}
    )
    result = validate(good, bad_tool, pythonpath=site)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == [
        f"{good}: valid RLRun 'good'",  # dataset files need not exist where one validates
        f"{bad_tool}: spec.rollout.tools: ['bash'] not offered by EchoEnv (it has say, look)",
    ]
    # Without the package (it lives only in the rollout image): one line, unless --no-import.
    result = validate(good)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"{good}: spec.rollout.environment: cannot import 'my_envs.echo' (ModuleNotFoundError: No module named "
        "'my_envs'); is its package installed, or on PYTHONPATH, where the rollout worker runs?"
    ]
    assert validate("--no-import", good).returncode == 0


def test_validate_refuses_an_unknown_name_and_a_malformed_path(tmp_path: Path) -> None:
    unknown = spec_with(tmp_path, "unknown", {"environment": "swebench"})
    malformed = spec_with(tmp_path, "malformed", {"environment": "my_envs.echo:"})
    result = validate(unknown, malformed)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"{unknown}: spec.rollout.environment: unknown environment 'swebench'; built in: filetree, coding, coding-plain "
        "(or your own as package.module:ClassName)",
        f"{malformed}: spec.rollout.environment: 'my_envs.echo:' is not an import path package.module:ClassName",
    ]


def test_mixrl_run_refuses_a_missing_dataset_file_before_starting_anything(tmp_path: Path) -> None:
    site = write_user_package(tmp_path / "site")
    train = write_words(tmp_path / "train.jsonl", ["apple"])
    spec = spec_with(
        tmp_path,
        "run",
        {
            "environment": USER_ENVIRONMENT,
            "dataset": {"train": str(train), "heldout": str(tmp_path / "none.jsonl")},
        },
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "run", str(spec), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"{spec}: spec.rollout.dataset.heldout: no such file {tmp_path / 'none.jsonl'}"
    ]
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- the Gymnasium adapter

SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=8, top_logprobs_num=0, return_sampling_mask=False
)


@pytest.fixture
def gym_adapter() -> Any:
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield load_environment(
            "gym_adapter:GymnasiumAdapter", {"env": "gym_adapter:GuessNumber", "max_guesses": 3}
        )
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.modules.pop("gym_adapter", None)


async def play(adapter: Any, task: Any, script: list[str]) -> tuple[Any, ScriptedReplies]:
    tokenizer = Tokenizer.from_words(adapter.vocabulary())
    generate = ScriptedReplies(tokenizer, script)
    trajectory = await run_episode(generate, adapter, task, tokenizer, SAMPLING, 8, 256, 3)
    return trajectory, generate


async def test_a_gymnasium_style_environment_plays_through_the_adapter(gym_adapter: Any) -> None:
    train = gym_adapter.generate_tasks("train", 20, seed=0)
    heldout = gym_adapter.generate_tasks("heldout", 20, seed=0)
    assert not {t.data["seed"] for t in train} & {t.data["seed"] for t in heldout}
    task = train[0]
    target = task.data["seed"] % 10
    low = (target + 9) % 10 if target else 1  # a wrong guess
    trajectory, generate = await play(gym_adapter, task, [f"act {low}", "act x", f"act {target}"])
    assert (trajectory.finish_reason, trajectory.reward, trajectory.num_turns) == ("terminated", 1.0, 3)
    tokenizer = generate.tokenizer
    assert tokenizer.decode(generate.received[0]) == "<bos> <|user|> guess a digit <|end|> <|assistant|>"
    first_answer = tokenizer.decode(generate.received[1][len(generate.received[0]) + 3 :])
    assert first_answer == f"<|tool|> {'higher' if low < target else 'lower'} <|end|> <|assistant|>"
    assert "not a digit" in tokenizer.decode(generate.received[2])
    # three wrong guesses: Gymnasium's truncation ends it, with no reward
    trajectory, generate = await play(gym_adapter, task, [f"act {low}"] * 3)
    assert (trajectory.finish_reason, trajectory.reward) == ("truncated", 0.0)
    assert "out of guesses" not in tokenizer.decode(generate.received[-1])  # the last step ended it


def test_the_adapter_validates_as_a_spec_names_it() -> None:
    from mixrl.api.models import RolloutSpec

    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = RolloutSpec(
            environment="gym_adapter:GymnasiumAdapter", environment_args={"env": "gym_adapter:GuessNumber"}
        )
        assert check_rollout(spec) == []
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.modules.pop("gym_adapter", None)


async def test_the_docs_full_example_is_an_environment_that_plays(tmp_path: Path) -> None:
    """docs/rollout.md's "A full example", as written there, imported as a user's package."""
    text = (ROOT / "docs" / "rollout.md").read_text()
    source = text.split("**A full example.**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "envs.py").write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        env = load_environment("my_pkg.envs:EchoEnv", {"prefix": "say"})
        tokenizer = Tokenizer.from_words(env.vocabulary())
        task = env.task_from_record({"id": "w0", "word": "pear"}, "train", 0)
        for reply, reward in (("say pear", 1.0), ("say plum", 0.0)):
            generate = ScriptedReplies(tokenizer, [reply])
            trajectory = await run_episode(generate, env, task, tokenizer, SAMPLING, 4, 128, 3)
            assert (trajectory.finish_reason, trajectory.reward) == ("said", reward)
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("my_pkg", "my_pkg.envs"):
            sys.modules.pop(name, None)


def test_validate_gives_one_line_for_an_environment_that_raises_and_checks_the_next_file(
    tmp_path: Path,
) -> None:
    adapter = "gym_adapter:GymnasiumAdapter"
    broken = spec_with(
        tmp_path, "broken", {"environment": adapter, "environmentArgs": {"env": "gym_adapter:NoSuch"}}
    )
    good = spec_with(
        tmp_path, "good", {"environment": adapter, "environmentArgs": {"env": "gym_adapter:GuessNumber"}}
    )
    result = validate(broken, good, pythonpath=EXAMPLES)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == [
        f"{broken}: spec.rollout.environmentArgs: {adapter} refused them: "
        "AttributeError: module 'gym_adapter' has no attribute 'NoSuch'",
        f"{good}: valid RLRun 'good'",
    ]
    assert "Traceback" not in result.stderr
