"""The real Helm CLI on charts/mixrl: ``helm lint`` and ``helm template``, which need no cluster.

The binary is the pinned Helm (v3.22) that ``scripts/k8s-bin.sh`` builds into a cache, found the
way the dev cluster finds its binaries (``$MIXRL_K8S_BIN``, else the script).  ``helm install``,
``upgrade`` and ``uninstall`` against a real API server are tests/cluster's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "mixrl"
KUBE_VERSION = "1.32.0"
"""What ``helm template`` renders for: a Helm built with ``go install`` assumes Kubernetes 1.20,
which the chart's ``kubeVersion`` (>= 1.28) refuses."""

Obj = dict[str, Any]


class HelmFailed(AssertionError):
    """Helm exited non-zero; the message is its stderr."""


@dataclass(frozen=True)
class Helm:
    binary: Path
    home: Path
    """Helm's cache, config and data directories live here (nothing outside the test's tmp)."""

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(self.home),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
            "KUBECONFIG": str(self.home / "no-kubeconfig"),  # template and lint never need one
        }
        done = subprocess.run([str(self.binary), *args], capture_output=True, text=True, env=env, timeout=120)
        if check and done.returncode != 0:
            raise HelmFailed(f"helm {' '.join(args)}: {done.stderr.strip()}")
        return done

    def values_file(self, values: Obj) -> Path:
        handle, name = tempfile.mkstemp(prefix="values-", suffix=".yaml", dir=self.home)
        os.close(handle)
        path = Path(name)
        path.write_text(yaml.safe_dump(values, sort_keys=False))
        return path

    def lint(self, values: Obj, chart: Path = CHART) -> subprocess.CompletedProcess[str]:
        """``helm lint --strict`` with ``values`` (exit status 0 when it passes)."""
        return self.run(
            "lint",
            str(chart),
            "--strict",
            "--kube-version",
            KUBE_VERSION,
            "-f",
            str(self.values_file(values)),
            check=False,
        )

    def template_text(
        self,
        values: Obj,
        chart: Path = CHART,
        namespace: str = "mixrl-system",
        release: str = "mixrl",
        *extra: str,
    ) -> str:
        return self.run(
            "template",
            release,
            str(chart),
            "--namespace",
            namespace,
            "--kube-version",
            KUBE_VERSION,
            "-f",
            str(self.values_file(values)),
            *extra,
        ).stdout

    def template(
        self, values: Obj, namespace: str = "mixrl-system", release: str = "mixrl", *extra: str
    ) -> list[Obj]:
        """The rendered objects (``crds/`` included, as ``helm install`` would create them)."""
        text = self.template_text(values, CHART, namespace, release, "--include-crds", *extra)
        return [doc for doc in yaml.safe_load_all(text) if doc]

    def refusal(self, values: Obj, release: str = "mixrl") -> str:
        """Helm's error for ``values`` (it must refuse them)."""
        done = self.run(
            "template",
            release,
            str(CHART),
            "--kube-version",
            KUBE_VERSION,
            "-f",
            str(self.values_file(values)),
            check=False,
        )
        assert done.returncode != 0, f"helm accepted {values}"
        return done.stderr.strip()

    def notes(self, values: Obj, directory: Path, namespace: str = "mixrl-system") -> str:
        """NOTES.txt as ``helm install`` prints it.  ``helm template`` never renders NOTES.txt and
        ``helm install`` has no ``--kube-version``, so a copy of the chart renders the same text
        through ``tpl`` into a ConfigMap."""
        copy = directory / "notes-chart"
        shutil.copytree(CHART, copy)
        (copy / "files" / "notes.tpl").write_text((CHART / "templates" / "NOTES.txt").read_text())
        (copy / "templates" / "zz-notes.yaml").write_text(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n"
            '  notes: {{ tpl (.Files.Get "files/notes.tpl") . | toJson }}\n'
        )
        text = self.template_text(values, copy, namespace, "mixrl", "--show-only", "templates/zz-notes.yaml")
        notes: str = yaml.safe_load(text)["data"]["notes"]
        return notes


def chart_with_values(values: Obj, directory: Path) -> Path:
    """A copy of the chart whose values.yaml is ``values``."""
    copy = directory / "mixrl"
    shutil.copytree(CHART, copy)
    (copy / "values.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    return copy


def default_values() -> Obj:
    values: Obj = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def clusterwide() -> Obj:
    """The defaults, but cluster-wide: the chart is namespaced unless asked (watch.allNamespaces)."""
    values = default_values()
    values["watch"]["allNamespaces"] = True
    return values


def everything_on() -> Obj:
    values = clusterwide()
    for feature in ("podMonitor", "prometheusRule", "grafanaDashboard"):
        values["monitoring"][feature]["enabled"] = True
    return values


def namespaced(*namespaces: str) -> Obj:
    values = everything_on()
    values["watch"] = {"allNamespaces": False, "namespaces": list(namespaces), "createNamespaces": False}
    return values
