# The two commands of the README: `make train` and `make test`. Both install into .venv first.
VENV ?= .venv
ARGS ?=

.PHONY: install train test bench

install:
	VENV=$(VENV) bash deploy/install.sh

train: install
	$(VENV)/bin/relayrl train $(ARGS)

test: install
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests $(ARGS)
