"""``mixrl validate``: the api's checks (:mod:`mixrl.api.validate_spec`), then the spec's environment
imported and checked (:func:`mixrl.rl.environments.registry.check_rollout`), unless ``--no-import``.

Dataset files are only required to be named here, not to exist: in a cluster they live in the
rollout image or on a volume; ``mixrl run`` and the rollout worker require them."""

from __future__ import annotations

from mixrl.api import validate_spec
from mixrl.api.models import RLRun
from mixrl.rl.environments.registry import check_rollout


def check_environment(run: RLRun) -> list[str]:
    return check_rollout(run.spec.rollout, check_files=False)


def main(argv: list[str]) -> int:
    return validate_spec.main(argv, check_environment)
