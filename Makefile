# The two commands of README.md: `make run` (the quickstart on this machine) and `make test`.
.PHONY: run test lint crds setup k8s-bin k8s-addons images
PY := .venv/bin

setup:
	@scripts/setup.sh

run: setup
	$(PY)/mixrl run examples/quickstart.yaml

# `make test`: set-up, lint, builds, then the suite, each phase timed (scripts/phase.sh; .ci/run
# prints the phases as a table). The suite is two pytest invocations (docs/testing.md): the tests
# not marked serial on both cores (pytest-xdist, a test module to a worker, one torch thread
# each), then the serial ones (a control plane, a real node, whole runs) in three lanes at once, each
# one at a time: the KWOK control-plane tests, the real node's, the rest (scripts/serial_lanes.sh). Both
# invocations run whatever fails in the other;
# JUnit files go to $(TEST_REPORTS) (scripts/test_times.py reads them).
TEST_BUILDS := k8s-bin k8s-addons images
TEST_REPORTS := .venv/test-reports
PYTEST := $(PY)/python -m pytest -q
PYTEST_ARGS ?=  # added to both invocations, e.g. PYTEST_ARGS="--ignore=tests/cluster"
test:
	@rm -rf $(TEST_REPORTS)
	@scripts/phase.sh set-up $(MAKE) --no-print-directory setup
	@scripts/phase.sh lint $(MAKE) --no-print-directory lint
	@scripts/phase.sh builds $(MAKE) --no-print-directory -j2 $(TEST_BUILDS)
	@mkdir -p $(TEST_REPORTS)
	@p=0; s=0; \
	OMP_NUM_THREADS=1 scripts/phase.sh "tests on 2 cores" $(PYTEST) -n 2 --dist loadscope -m "not serial" \
	  --junitxml=$(TEST_REPORTS)/parallel.xml $(PYTEST_ARGS) || p=$$?; \
	scripts/phase.sh "serial tests" scripts/serial_lanes.sh $(TEST_REPORTS) $(PYTEST) $(PYTEST_ARGS) || s=$$?; \
	$(PY)/python scripts/test_times.py --totals $(TEST_REPORTS)/*.xml; \
	rc=0; for r in $$p $$s; do [ $$r -eq 0 ] || [ $$r -eq 5 ] || rc=$$r; done; \
	[ $$p$$s != 55 ] || rc=5; exit $$rc

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
