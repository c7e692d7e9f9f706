"""Chart tests: charts/mixrl against its schema, the code it is generated from, and Helm itself.

Real: the chart, values.schema.json (jsonschema, and Helm's own schema check), Helm's Go library
(`helm lint` and `helm install`, through helm-sdkpy in a Python 3.12 environment at .venv-helm —
the tests that need it are skipped, with the reason, when it is missing), promtool's rule checker
and rule unit tests (Debian's prometheus package; skipped when promtool is missing), and
Kubernetes' OpenAPI schemas (kubernetes-validate) for every installed object.
Stand-in: the Kubernetes API server that `helm install` talks to is the kmock-based emulator of
tests/operator/emulator.py (it stores what Helm creates; nothing runs it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import kmock
import pytest

from ..operator.emulator import ApiServer
from .helm import HELM_PYTHON


@pytest.fixture
def helm_available() -> None:
    if not HELM_PYTHON.exists():
        pytest.skip(
            f"no Helm: {HELM_PYTHON} missing (create it: python3.12 -m venv .venv-helm && .venv-helm/bin/pip install helm-sdkpy)"
        )


@pytest.fixture
async def cluster(helm_available: None) -> AsyncIterator[ApiServer]:
    """An empty API server (no mixrl or kopf kinds until their CRDs are installed)."""
    async with ApiServer() as server, kmock.Server(server):
        server.register(with_monitoring=True, with_cluster_basics=True, crds=False)
        yield server
