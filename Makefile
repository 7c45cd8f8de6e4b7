# The two commands of the README. Each sets up ./.venv itself (see scripts/setup_env.sh).
PY := .venv/bin/python
PYTEST_ARGS ?= -m "not slow and not gpu"

.PHONY: train test setup setup-test bench-attention clean

train: setup
	$(PY) examples/train_hstu.py $(ARGS)

test: setup-test
	$(PY) -m pytest tests -q $(PYTEST_ARGS)

setup:
	scripts/setup_env.sh

setup-test:
	scripts/setup_env.sh --test

clean:
	rm -rf .venv build *.egg-info .pytest_cache
