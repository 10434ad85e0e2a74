"""The process-level side of a run: the driver (trainer.py) and the CLI, Ray start-up and placement, the learner
and critic rank groups, worker supervision, checkpoints and resume, evaluation, the demo model and the simulator."""
