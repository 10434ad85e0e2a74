"""How weights travel from learner rank 0 to the rollout engines, in one place that both sides import: the transport
interface (transport.py), the backends with their senders and receivers (backends.py lists them; one module each),
delta encoding (delta.py), LoRA's adapter-only payload and its folders (lora.py), and the driver's check that the engines hold what was published (sync_check.py). The
announcement of a version is protocols/weight_announcement.py. Torch and numpy at load; Ray only inside methods."""
