# The two commands of README.md: `make run` (the quickstart on this machine) and `make test`.
.PHONY: run test lint crds setup k8s-bin k8s-addons images
PY := .venv/bin

setup:
	@scripts/setup.sh

run: setup
	$(PY)/mixrl run examples/quickstart.yaml

# `make test`: set-up, lint, builds, then the suite, each phase timed (scripts/phase.sh; .ci/run
# prints the phases as a table). The suite runs in four lanes (scripts/test_lanes.sh,
# docs/testing.md): the tests not marked serial on both cores (pytest-xdist, a test module to a
# worker, one torch thread each) beside the KWOK control-plane tests; after them, the real node's
# tests beside the whole runs (the serial lanes one test at a time).
# JUnit files go to $(TEST_REPORTS) (scripts/test_times.py reads them).
TEST_BUILDS := k8s-bin k8s-addons images
TEST_REPORTS := .venv/test-reports
PYTEST := $(PY)/python -m pytest -q
PYTEST_ARGS ?=  # added to every lane's pytest, e.g. PYTEST_ARGS="--ignore=tests/cluster"
test:
	@rm -rf $(TEST_REPORTS)
	@scripts/phase.sh set-up $(MAKE) --no-print-directory setup
	@scripts/phase.sh lint $(MAKE) --no-print-directory lint
	@scripts/phase.sh builds $(MAKE) --no-print-directory -j2 $(TEST_BUILDS)
	@mkdir -p $(TEST_REPORTS)
	@rc=0; scripts/phase.sh tests scripts/test_lanes.sh $(TEST_REPORTS) $(PYTEST) $(PYTEST_ARGS) || rc=$$?; \
	$(PY)/python scripts/test_times.py --totals $(TEST_REPORTS)/*.xml; exit $$rc

lint:
	$(PY)/ruff check mixrl tests bench
	$(PY)/ruff format --check mixrl tests bench
	$(PY)/lint-imports
	$(PY)/mypy
	$(PY)/mixrl crds --check
	$(PY)/python -m mixrl.operator.install.chart --check

# The pinned Kubernetes, etcd, KWOK, Helm and CoreDNS binaries of the local test bed, and the
# project's images for its real node (as root; both cached outside the repo). make test builds them
# at the same time: the compiles keep the cores busy while the images' downloads wait on the network.
k8s-bin:
	@scripts/k8s-bin.sh >/dev/null

# Kueue, LeaderWorkerSet and KEDA, run by the test bed beside its control plane (scripts/k8s-addons.sh).
k8s-addons:
	@scripts/k8s-addons.sh >/dev/null

images:
	@scripts/images.sh >/dev/null

crds: setup
	$(PY)/mixrl crds
