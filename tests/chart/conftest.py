"""Chart tests: charts/mixrl against its schema, the code it is generated from, and Helm itself.

Real: the chart, values.schema.json (jsonschema, and Helm's own schema check), the Helm CLI
(``helm lint`` and ``helm template``, v3.22 built by scripts/k8s-bin.sh; no cluster), the
operator's own command-line parser and builders fed the flags the chart renders, promtool's rule
checker and rule unit tests (Debian's prometheus package; skipped when promtool is missing), and
Kubernetes' OpenAPI schemas (kubernetes-validate) for every rendered object.  ``helm install`` into
a real API server is tests/cluster's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mixrl.devcluster.cluster import ClusterError, binaries_dir

from .helm import Helm


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """The pinned Helm CLI.  No skip without it: ``scripts/k8s-bin.sh`` builds it (or say where it
    is with ``MIXRL_K8S_BIN``)."""
    try:
        binary = binaries_dir() / "helm"
    except ClusterError as exc:
        pytest.fail(f"no Helm: {exc}")
    if not binary.is_file():
        pytest.fail(f"no Helm at {binary}: run scripts/k8s-bin.sh")
    home: Path = tmp_path_factory.mktemp("helm-home")
    return Helm(binary, home)
