"""From ``rollout.environment`` to an environment object, and the checks made before a run starts.

``rollout.environment`` is a built-in name (:data:`BUILT_IN`) or an import path
``package.module:ClassName``; ``rollout.environmentArgs`` are the constructor's keyword arguments.
:func:`load_environment` imports and builds it; :func:`check_rollout` is what ``mixrl validate``,
``mixrl run`` and the rollout worker run: the environment can be imported and built, implements
the API, offers the tools the spec names, has tasks for both splits (a generator, or dataset
files that exist), and passes the environment's own check of the spec (:class:`ChecksRollout`, when
it has one).  Every problem is one line naming its field (``spec.rollout.environment: ...``), also
when the environment's own code raises: a traceback would hide the files ``mixrl validate`` has yet
to check.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mixrl.api.models import RolloutSpec
from mixrl.rl.environments.base import SPLITS, Environment, NoTaskGenerator
from mixrl.rl.environments.datasets import DATASET_SUFFIXES
from mixrl.rl.environments.tools import Tool

BUILT_IN: dict[str, str] = {
    "filetree": "mixrl.rl.environments.filetree:FileTreeEnvironment",
    "coding": "mixrl.rl.environments.coding:CodingEnvironment",
    "coding-plain": "mixrl.rl.environments.coding:PlainCodingEnvironment",
}
"""Built-in environment names -> their import paths."""

FIELD = "spec.rollout.environment"


class EnvironmentUnavailable(ValueError):
    """The spec's environment cannot be used; the message is one line naming the field."""


@runtime_checkable
class ChecksRollout(Protocol):
    """An environment that checks the spec's ``rollout`` section for what only it knows (the tools an
    episode needs to earn a reward, how many tasks its generator holds).  Optional, as the base API
    has no such method: :func:`check_rollout` calls it after the generic checks."""

    def rollout_problems(self, rollout: RolloutSpec) -> list[str]:
        """Problems, one line each naming its field (``spec.rollout.tools: ...``); none: fine."""
        ...


def _raised(exc: BaseException) -> str:
    """An exception from the environment's own code, on one line.  A ValueError or TypeError is its
    refusal and speaks for itself; anything else is a failure, whose type says more than its text."""
    text = " ".join(str(exc).split())
    if isinstance(exc, (TypeError, ValueError)):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def import_path(name: str) -> str:
    return BUILT_IN.get(name, name)


def environment_class(name: str) -> type[Environment[Any]]:
    """The class ``rollout.environment`` names, imported."""
    path = import_path(name)
    module_name, _, class_name = path.partition(":")
    if not class_name:
        raise EnvironmentUnavailable(
            f"{FIELD}: unknown environment {name!r}; built in: {', '.join(BUILT_IN)} "
            "(or your own as package.module:ClassName)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvironmentUnavailable(
            f"{FIELD}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); is its package "
            "installed, or on PYTHONPATH, where the rollout worker runs?"
        ) from None
    found = getattr(module, class_name, None)
    if found is None:
        raise EnvironmentUnavailable(f"{FIELD}: module {module_name!r} has no {class_name!r}")
    if not (inspect.isclass(found) and issubclass(found, Environment)):
        raise EnvironmentUnavailable(
            f"{FIELD}: {path} is not a subclass of mixrl.rl.environments.base.Environment"
        )
    if inspect.isabstract(found):
        missing = ", ".join(sorted(found.__abstractmethods__))
        raise EnvironmentUnavailable(f"{FIELD}: {path} does not implement {missing}")
    return found


def load_environment(name: str, args: Mapping[str, Any] | None = None) -> Environment[Any]:
    """Import and build the environment (``Class(**args)``); one line when it cannot be."""
    cls = environment_class(name)
    try:
        return cls(**dict(args or {}))
    except Exception as exc:  # the user's code: an AttributeError, an ImportError... is one line too
        raise EnvironmentUnavailable(
            f"spec.rollout.environmentArgs: {name} refused them: {_raised(exc)}"
        ) from None


def offered_tools(environment: Environment[Any], wanted: Sequence[str] | None) -> list[Tool]:
    """The tools the episode offers: ``rollout.tools`` among the environment's (null = all)."""
    try:
        tools = list(environment.tools())
    except Exception as exc:  # the user's code, as in load_environment
        raise EnvironmentUnavailable(
            f"{FIELD}: {type(environment).__name__}.tools() failed: {_raised(exc)}"
        ) from None
    if wanted is None:
        return tools
    by_name = {tool.name: tool for tool in tools}
    unknown = [name for name in wanted if name not in by_name]
    if unknown:
        raise EnvironmentUnavailable(
            f"spec.rollout.tools: {unknown} not offered by {type(environment).__name__} "
            f"(it has {', '.join(by_name)})"
        )
    return [by_name[name] for name in wanted]


def check_rollout(rollout: RolloutSpec, *, check_files: bool = True) -> list[str]:
    """Problems that stop the rollout worker from playing this spec, one line each (none: fine).

    ``check_files``: whether the dataset files must exist here (``mixrl run``, the worker), not
    only be named (``mixrl validate``: in a cluster they live in the rollout image or a volume)."""
    try:
        environment = load_environment(rollout.environment, rollout.environment_args)
        offered_tools(environment, rollout.tools)
    except EnvironmentUnavailable as exc:
        return [str(exc)]
    problems: list[str] = []
    for split in SPLITS:
        path = getattr(rollout.dataset, split)
        field = f"spec.rollout.dataset.{split}"
        if path is None:
            try:
                environment.generate_tasks(split, 1, rollout.dataset.seed)
            except NoTaskGenerator:
                problems.append(
                    f"{field}: {rollout.environment} generates no tasks; name a JSONL or Parquet file"
                )
            except Exception as exc:  # the user's code, as in load_environment
                problems.append(f"{field}: {rollout.environment} cannot generate a task: {_raised(exc)}")
            continue
        if Path(path).suffix not in DATASET_SUFFIXES:
            problems.append(f"{field}: {path!r} is neither {' nor '.join(DATASET_SUFFIXES)}")
        elif check_files and not Path(path).is_file():
            problems.append(f"{field}: no such file {path}")
    if isinstance(environment, ChecksRollout):
        try:
            problems += environment.rollout_problems(rollout)
        except Exception as exc:  # the user's code, as in load_environment
            problems.append(f"{FIELD}: {rollout.environment} failed checking the spec: {_raised(exc)}")
    return problems
