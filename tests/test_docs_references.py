"""The docs and the code point at things that exist: the docs' paths and modules, and the
docs/architecture.md headings the code cites."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH_IN_BACKTICKS = re.compile(r"`((?:mixrl|tests|bench|scripts|charts|crds|examples|images)/[^`\s]*)`")
MODULE = re.compile(
    r"\bmixrl(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?![\w/])"
)  # not a format tag like mixrl.weights/v1
CITATION = re.compile(r"docs/architecture\.md#([a-z0-9-]+)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_path_the_docs_name_exists() -> None:
    missing = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for match in PATH_IN_BACKTICKS.finditer(line):
                path = match.group(1).rstrip("/").split("#")[0].split(":")[0]
                if any(c in path for c in "<>*{⟨"):
                    continue  # a pattern, not a path
                if not (ROOT / path).exists():
                    missing.append(f"{doc.name}:{number}: {path}")
    assert not missing, "docs name paths that do not exist:\n" + "\n".join(missing)


def test_every_module_the_docs_name_exists() -> None:
    missing = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for match in MODULE.finditer(line):
                parts = match.group(0).split(".")
                found = any(
                    (ROOT / Path(*parts[:k])).with_suffix(".py").exists()
                    or (ROOT / Path(*parts[:k])).is_dir()
                    for k in range(2, len(parts) + 1)
                )
                if not found and match.group(0) != "mixrl.dev":  # the API group, not a module
                    missing.append(f"{doc.name}:{number}: {match.group(0)}")
    assert not missing, "docs name modules that do not exist:\n" + "\n".join(missing)


def test_every_architecture_heading_the_code_cites_exists() -> None:
    headings = {
        github_anchor(line.lstrip("#"))
        for line in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    }
    cited = {
        (path.relative_to(ROOT), anchor)
        for folder in ("mixrl", "tests", "bench", "docs")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".py", ".md"}
        for anchor in CITATION.findall(path.read_text(encoding="utf-8"))
    }
    assert cited, "the code cites docs/architecture.md"
    broken = sorted(f"{path}: #{anchor}" for path, anchor in cited if anchor not in headings)
    assert not broken, "citations of headings that docs/architecture.md does not have:\n" + "\n".join(broken)


KUBECTL_GET = re.compile(r"kubectl get ([^\s`]+)[^`\n]*?(?:\s-w\b|--watch\b)")
NOTES = ROOT / "charts" / "mixrl" / "templates" / "NOTES.txt"


def test_documented_watches_name_one_type() -> None:
    """``kubectl get a,b -w`` is refused by kubectl ("you may only specify a single resource type")."""
    wrong = []
    for doc in [*DOCS, NOTES]:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for match in KUBECTL_GET.finditer(line):
                if "," in match.group(1):
                    wrong.append(f"{doc.name}:{number}: {line.strip()}")
    assert not wrong, "watches of several types:\n" + "\n".join(wrong)


def test_notes_commands_on_a_run_name_its_namespace() -> None:
    """The run lives in a namespace of its own, not in the one the user's kubeconfig defaults to."""
    lines = [line.strip() for line in NOTES.read_text().splitlines()]
    run_commands = [
        line for line in lines if re.match(r"kubectl (get|describe|scale|apply) (rlrun|samplerpool)", line)
    ]
    run_commands += [line for line in lines if line.startswith("kubectl apply")]
    assert run_commands
    assert [line for line in run_commands if " -n " not in line] == []
