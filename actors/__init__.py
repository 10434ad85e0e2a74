"""Ray actors of the pipeline: rollout workers (vLLM engines), reward workers, reference workers (the frozen
reference's log-probs), critic workers (PPO's values), and the controller with its replay queue, leases and
prompt cursor."""
