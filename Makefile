# The two commands of the README. Each sets up ./.venv itself (see scripts/setup_env.sh).
PY := .venv/bin/python
PYTEST_ARGS ?= -m "not slow and not gpu"
# pytest-xdist workers ("auto": one per core; 0: one process). --durations: the slowest tests, so
# that a test which grows slow is seen in every CI log.
PYTEST_WORKERS ?= auto
PYTEST_OPTS = -q -n $(PYTEST_WORKERS) --durations=25

.PHONY: train test test-fast setup setup-test bench-attention clean

train: setup
	$(PY) examples/train_hstu.py $(ARGS)

test: setup-test
	$(PY) -m pytest tests $(PYTEST_OPTS) $(PYTEST_ARGS)

# Inner loop (~290 CPU-s: about 2.5 min on 2 idle cores): everything but the tests marked ``heavy`` (see tests/conftest.py).
test-fast: setup-test
	$(PY) -m pytest tests $(PYTEST_OPTS) -m "not slow and not gpu and not heavy"

setup:
	scripts/setup_env.sh

setup-test:
	scripts/setup_env.sh --test

clean:
	rm -rf .venv build *.egg-info .pytest_cache
