# The two commands of README.md: `make run` (the quickstart on this machine) and `make test`.
.PHONY: run test lint crds setup k8s-bin
PY := .venv/bin

setup:
	@scripts/setup.sh

run: setup
	$(PY)/mixrl run examples/quickstart.yaml

test: setup lint k8s-bin
	$(PY)/python -m pytest -q

lint:
	$(PY)/ruff check mixrl tests bench
	$(PY)/ruff format --check mixrl tests bench
	$(PY)/lint-imports
	$(PY)/mixrl crds --check
	$(PY)/python -m mixrl.operator.install.chart --check

# The pinned Kubernetes, etcd, KWOK and Helm binaries of the local test bed (cached outside the repo).
k8s-bin:
	@scripts/k8s-bin.sh >/dev/null

crds: setup
	$(PY)/mixrl crds
