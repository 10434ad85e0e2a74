"""The learner: the objective maths (objective.py and the modules it composes) and, later, the training loop."""
