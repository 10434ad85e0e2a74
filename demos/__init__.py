"""The demo tasks' policies, built on this machine when `model.path` is empty (cluster/model_folder.py picks one):
tiny Qwen2 models with character tokenizers for the arithmetic task (arithmetic_model.py; tool_task.py adds the
calculator demo's tool tokens, examples and plain-torch rollouts) and for the long chain-of-thought task
(longcot_model.py). Both are warm-started by one supervised loop (warm_start.py) so that RL starts from a partly
able model, and built once per settings into a cache (model_cache.py)."""
