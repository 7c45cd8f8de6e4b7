# The two commands of the README. Each sets up ./.venv itself (see scripts/setup_env.sh).
PY := .venv/bin/python
PYTEST_ARGS ?= -m "not slow and not gpu"
# pytest-xdist workers ("auto": one per core; 0: one process), fed the longest tests first from
# tests/durations.txt (see tests/conftest.py). --durations: the slowest tests, so that a test which
# grows slow is seen in every CI log.
PYTEST_WORKERS ?= auto
PYTEST_OPTS = -q -n $(PYTEST_WORKERS) --durations=25
# Bytecode caching on for every recipe, whatever the shell exports: setup installs with --no-compile, so the
# first import writes each module's .pyc into .venv and every later process (xdist workers, the tests' spawned
# interpreters) loads it instead of compiling torch from source again (~7 s of CPU per process on 2 cores).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: train train-rab test test-all test-fast test-inductor durations setup setup-test setup-examples bench-attention clean

train: setup-examples
	$(PY) examples/train_hstu.py $(ARGS)

# The same job for an HSTU model with the original relative attention bias (examples/train_hstu_rab.py).
train-rab: setup-examples
	$(PY) examples/train_hstu_rab.py $(ARGS)

test: setup-test
	$(PY) -m pytest tests $(PYTEST_OPTS) $(PYTEST_ARGS)

# Every CPU test, the ``slow`` ones too (tests/conftest.py HALVED: the other half of each halved family):
# before a release, after changing what a halved family covers, and at each stop beside CI.
test-all: setup-test
	$(PY) -m pytest tests $(PYTEST_OPTS) -m "not gpu"

# Inner loop: everything but the tests marked ``heavy`` (see tests/conftest.py). `make test` (CI)
# from a fresh clone, setup and cold cache included: README "Development".
test-fast: setup-test
	$(PY) -m pytest tests $(PYTEST_OPTS) -m "not slow and not gpu and not heavy"

# The rewrite tests (tests/patterns) run with backend="hstu_eager" (tests/_helpers.py: the same
# rewrites, no C++ generated); this runs them through Inductor's code generation as well (about twice
# as long). Before a release, or after touching how a rewritten graph reaches Inductor.
test-inductor: setup-test
	HSTU_TEST_REWRITE_BACKEND=hstu $(PY) -m pytest tests/patterns $(PYTEST_OPTS) $(PYTEST_ARGS)

# Re-measure tests/durations.txt (the longest-first order of `make test`); commit the result.
durations: setup-test
	$(PY) -m pytest tests -q -n $(PYTEST_WORKERS) --durations=0 $(PYTEST_ARGS) | tee .durations.log
	$(PY) scripts/test_durations.py .durations.log

setup:
	scripts/setup_env.sh

setup-test:
	scripts/setup_env.sh --test

# setup plus the examples' optional extras (tqdm, matplotlib), skipped if they cannot be installed
setup-examples:
	scripts/setup_env.sh --examples

clean:
	rm -rf .venv build *.egg-info .pytest_cache .durations.log train_hstu_loss.png train_hstu_rab_loss.png
