"""The learner: the objective maths (objective.py and the pure-torch modules it composes), batching and
micro-batch plans, the chunked LM head, sequence parallelism, and the rank modules (learner_actor.py,
critic_rank.py, rank_*.py) that run one DeepSpeed rank of the policy or the critic and publish its weights (through
the transports in weights/). DeepSpeed is imported only inside those modules' methods, never at load; Ray never."""
