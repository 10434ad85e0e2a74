"""Schemas for every record that crosses an actor boundary or a file: the run config and its sections, prompts,
trajectories, verifier results, metric names, and the torch records (the training batch, the weight wire format).
Only pydantic, PyYAML (config files), torch and the stdlib here, so both sides of any boundary may import them."""
