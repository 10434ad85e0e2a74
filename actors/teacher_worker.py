"""Teacher worker: a Ray actor that holds a frozen teacher model and computes its log-probs of every response
token while groups stream from the rollout workers to the replay queue (on-policy distillation).

It is the reference worker (actors/reference_worker.py) with another model and its own forward budget: the same
scoring code as the learner (dtype, attention kernel, micro-batch planner, chunked head, sampling temperature),
so log pi_teacher and the behavior log-probs mu are on the same scale. The rollout worker's router sends each
group to one teacher worker beside its reward task (Trajectory.teacher_logprobs); tool output tokens are scored
as context but carry no loss, as everywhere. learner/distillation.py turns the numbers into advantages.
"""

from actors.reference_worker import ReferenceWorker


class TeacherWorker(ReferenceWorker):
    role = "teacher"
