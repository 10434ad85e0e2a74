"""Process-level pieces of a run: the Ray cluster, the actors placed on it and the models they load."""
