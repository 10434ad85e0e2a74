# The two commands of the README: `make train` and `make test`. Both install into .venv first.
VENV ?= .venv
ARGS ?=

.PHONY: install train train-longcot test bench

install:
	VENV=$(VENV) bash deploy/install.sh

train: install
	$(VENV)/bin/relayrl train $(ARGS)

# The long chain-of-thought demo (docs/longcot_demo.md): long-tailed responses, partial rollouts, token budgets.
train-longcot: install
	$(VENV)/bin/relayrl train --config deploy/configs/demo_longcot.yaml $(ARGS)

# Pure tests run first (tests/conftest.py orders them), and the 20 slowest are listed at the end of every run
# so that a test that grows shows.
test: install
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=20 tests $(ARGS)
