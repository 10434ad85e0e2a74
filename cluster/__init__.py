"""The job's orchestration: the driver (trainer.py), a worker pool per role (pools.py) and their supervision, Ray
start-up and placement, the learner and critic rank groups, checkpoints and resume, the run folder, the model
folder a run loads, and held-out evaluation on the run's own workers (evaluation.py; `relayrl eval` starts
workers of its own). The command line is in cli/, the demo models in demos/, the simulator in simulator/."""
