"""Ray actors of the pipeline: rollout workers, reward workers, the replay queue and the controller."""
