"""learner.uncheckpointed_layers and checkpoint_keeps_attention: what backward recomputes changes; the numbers never
change."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.rank_setup import attention_kernels, enable_gradient_checkpointing


def tiny_model() -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).train()


def loss_and_grads(model: Qwen2ForCausalLM) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_last_layers_are_left_uncheckpointed():
    model = tiny_model()
    # 4 layers, 1 left out: layers 0-2 recompute, layer 3 keeps its activations
    assert enable_gradient_checkpointing(model, 1) == 3
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, True, True, False]
    # more than there are: none checkpointed
    assert enable_gradient_checkpointing(tiny_model(), 9) == 0


def test_partial_checkpointing_gives_the_same_loss_and_gradients():
    plain_loss, plain_grads = loss_and_grads(tiny_model())
    model = tiny_model()
    enable_gradient_checkpointing(model, 2)
    loss, grads = loss_and_grads(model)
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-6)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


class AttentionKernelCounter(TorchDispatchMode):
    """Counts the fused attention kernels that actually run (a kernel whose output selective checkpointing kept
    is answered from its cache and never reaches this mode)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.kernels = attention_kernels()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in self.kernels
        return func(*args, **(kwargs or {}))


def attention_calls_and_grads(keep_attention: bool | None) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    model = tiny_model()
    if keep_attention is not None:
        enable_gradient_checkpointing(model, 0, keep_attention)
    with AttentionKernelCounter() as counter:
        loss, grads = loss_and_grads(model)
    return counter.calls, loss, grads


def test_keeping_attention_outputs_skips_their_recompute_and_changes_no_number():
    plain_calls, plain_loss, plain_grads = attention_calls_and_grads(None)
    full_calls, _, _ = attention_calls_and_grads(False)
    kept_calls, loss, grads = attention_calls_and_grads(True)
    # 4 layers: forward runs 4 kernels; full checkpointing re-runs them in backward (4 + 4 = 8); keeping their
    # outputs leaves only the 4 of the forward
    assert (plain_calls, full_calls, kept_calls) == (4, 8, 4)
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-6)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
