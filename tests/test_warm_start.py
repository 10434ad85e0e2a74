"""The demos' one supervised warm start (demos/warm_start.py): a step's loss is the mean over all its targets,
however its rows are cut into micro-batches, and two checks in a row at the target stop it."""

import torch
from transformers import Qwen2ForCausalLM

from demos.arithmetic_model import build_random_model
from demos.warm_start import supervised_warm_start

# 4 examples of 6 tokens; the mask holds 1, 2, 3 and 4 targets, so a per-micro-batch mean would weigh them unequally
IDS = torch.tensor([[1, 3, 4, 14, 5, 2], [1, 5, 6, 14, 7, 2], [1, 7, 8, 14, 9, 2], [1, 9, 10, 14, 11, 2]])
MASK = torch.zeros_like(IDS, dtype=torch.bool)
for row, targets in enumerate((1, 2, 3, 4)):
    MASK[row, 6 - targets :] = True


def one_step(folder: str, split: bool) -> tuple[float, Qwen2ForCausalLM]:
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def micro_batches(rows, generator):
        ids, mask = IDS[rows], MASK[rows]
        return [(ids[:2], mask[:2]), (ids[2:], mask[2:])] if split else [(ids, mask)]

    result = supervised_warm_start(model, len(IDS), micro_batches, steps=1, lr=1e-3, batch_size=4, seed=0)
    return result.losses[0], model


def test_micro_batches_of_a_step_give_the_loss_and_gradient_of_one_batch(tmp_path):
    folder = build_random_model(tmp_path, tied=True, seed=0)
    whole_loss, whole = one_step(folder, split=False)
    split_loss, split = one_step(folder, split=True)
    # each micro-batch divides its summed token losses by the whole step's target count, not by its own
    assert abs(whole_loss - split_loss) < 1e-5
    # the step's gradient stays on the parameters until the next step (Adam's first update is about lr * sign(g),
    # so the updated weights would magnify float noise in near-zero gradients)
    for a, b in zip(whole.parameters(), split.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=1e-4)


def test_two_checks_in_a_row_at_the_target_stop_it(tmp_path):
    # checks at steps 3, 6, 9, ...: misses at 3, hits at 6 and 9, so training stops after step 9
    folder = build_random_model(tmp_path, tied=True, seed=0)
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    verdicts = iter([False, True, True, True])
    result = supervised_warm_start(
        model, len(IDS), lambda rows, generator: [(IDS[rows], MASK[rows])], steps=100, lr=1e-3, batch_size=2,
        seed=0, check=lambda model: (next(verdicts), {"accuracy": 0.5}), check_every=3)
    assert len(result.losses) == 9 and result.check == {"accuracy": 0.5}
    assert not model.training
