"""``mixrl validate``: the api's checks (:mod:`mixrl.api.validate_spec`), then the spec's environment
imported and checked (:func:`mixrl.rl.environments.registry.check_rollout`), unless ``--no-import``.

Dataset files are only required to be named here, not to exist: in a cluster they live in the
rollout image or on a volume; ``mixrl run`` and the rollout worker require them."""

from __future__ import annotations

from mixrl.api import validate_spec
from mixrl.api.models import RLRun
from mixrl.rl.environments.registry import check_rollout
from mixrl.rl.sandbox.backend import NoCommands, use_sandbox


def check_environment(run: RLRun) -> list[str]:
    if run.spec.rollout.sandbox is None:
        return check_rollout(run.spec.rollout, check_files=False)
    # Its commands run in sandbox pods, not on this machine: no bubblewrap sandbox is needed here.
    previous = use_sandbox(lambda _config: NoCommands("mixrl validate"))
    try:
        return check_rollout(run.spec.rollout, check_files=False)
    finally:
        use_sandbox(previous)


def main(argv: list[str]) -> int:
    return validate_spec.main(argv, check_environment)
