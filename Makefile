# The two commands of the README: `make train` and `make test`. Both install into .venv first, for the device the
# venv was first installed for (`RELAYRL_DEVICE=gpu make install` once; deploy/install.sh records it and refuses the
# other device's stack over it).
VENV ?= .venv
ARGS ?=

.PHONY: install train train-longcot train-tools train-tools-no-tools train-agent train-outside train-distill test bench

install:
	VENV=$(VENV) bash deploy/install.sh

train: install
	$(VENV)/bin/relayrl train $(ARGS)

# The long chain-of-thought demo (docs/longcot_demo.md): long-tailed responses, partial rollouts, token budgets.
train-longcot: install
	$(VENV)/bin/relayrl train --config deploy/configs/demo_longcot.yaml $(ARGS)

# The tool demo (docs/tools_demo.md): products with the calculator tool, and the same task without it.
train-tools: install
	$(VENV)/bin/relayrl train --config deploy/configs/demo_tools.yaml $(ARGS)

train-tools-no-tools: install
	$(VENV)/bin/relayrl train --config deploy/configs/demo_tools_no_tools.yaml $(ARGS)

# The agent demo (docs/agents.md): the products task played by an `openai` SDK agent through the session endpoint.
train-agent: install
	$(VENV)/bin/relayrl train --config deploy/configs/demo_agent.yaml $(ARGS)

# A run fed by outside agents alone (docs/agents.md): the run serves its endpoints, and the agent program beside it
# (demos/outside_agent.py, its own process) plays the products task through them until the run ends.
train-outside: install
	$(VENV)/bin/relayrl train --config deploy/configs/demo_outside.yaml $(ARGS) & \
	$(VENV)/bin/python demos/outside_agent.py runs/demo_outside; wait

# On-policy distillation (docs/distillation.md): a longer-trained teacher, then RL, the mix and distillation from
# the same student on the addition demo (three jobs of 200 steps, one after the other, then every final model and
# the teacher on the whole held-out split; ARGS="--steps 800 --modes rl,distill_full_256x1_cos" for the run behind
# the goals, ARGS="--modes ..." for any of the benchmark's eleven modes); writes
# runs/distill/{table.md,results.json,distillation.png}.
train-distill: install
	$(VENV)/bin/python benchmarks/distillation.py --out runs/distill $(ARGS)

# Pure tests run first (tests/conftest.py orders them), skip reasons are printed (-rs: a source check with no wheel
# to read says why), and the 20 slowest are listed at the end of every run
# so that a test that grows shows. TEST_WORKERS=2 shares the tests between two pytest-xdist processes, a module whole
# on one of them (--dist loadfile: a costly module fixture, an engine or a three-node cluster, starts once;
# xdist_group marks would not do it under pytest 9.2 with pytest-xdist 3.8, whose rename of the test ids pytest
# no longer reads). On the 2-core development machine, a clean clone on 2026-11-29: 28 min 56 s in two processes
# against 28 min 44 s in one, every test passing in both (docs/test_suite.md: where the time goes). An earlier
# two-process run lost two tests to timeouts beside the other process (a Ray start, the sandbox's fork bomb). The tests
# are CPU-bound, so one process stays the default.
TEST_WORKERS ?= 0
test: install
	$(VENV)/bin/python -m pytest -q -rs -p no:cacheprovider --durations=20 -n $(TEST_WORKERS) --dist loadfile tests $(ARGS)
