"""What the GPU learner benchmarks share (benchmarks/learner_gpu.py, long_cot_gpu.py, gpu_presets.py,
long_batches.py): random-init Qwen2.5-shaped model folders, synthetic shards, timing and memory helpers, and the
record of one measured configuration.
"""

from __future__ import annotations

import gc
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch

SHAPES = {
    # Qwen2.5-0.5B / 1.5B: same layout, random weights.
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960),
    # For a CPU smoke test of the script only (--allow-cpu).
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=128),
}
VOCAB = 151936
PAD_ID = 151643  # Qwen2.5's <|endoftext|>, its pad token


# --------------------------------------------------------------------------------------------- model folder


def build_model_folder(shape: str, root: Path, vocab: int, device: str,
                       max_positions: int = 32768) -> tuple[Path, int]:
    """Random-init Qwen2 of the named shape plus a trivial tokenizer, saved as a Hugging Face folder."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder = root / f"qwen2-{shape}"
    pad_id = min(PAD_ID, vocab - 1)
    config = Qwen2Config(vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=max_positions,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, pad_token_id=pad_id, bos_token_id=pad_id,
                         eos_token_id=pad_id, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    n_params = sum(p.numel() for p in model.parameters())  # tied head counted once
    model.save_pretrained(folder)
    del model
    tok = Tokenizer(WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>").save_pretrained(folder)
    return folder, n_params


# ------------------------------------------------------------------------------------------- synthetic data


def make_shard(n: int, prompt_len: int, resp_len: int, vocab: int, seed: int):
    """A TrainingBatch of n random samples: advantages +1 / -1 alternating, behavior log-probs around -2."""
    from protocols.training_batch import TrainingBatch

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (n, prompt_len), generator=g).tolist()
    responses = torch.randint(0, vocab, (n, resp_len), generator=g).tolist()
    signs = [1.0 if i % 2 == 0 else -1.0 for i in range(n)]
    behavior = (-2.0 + 0.5 * torch.randn(n, resp_len, generator=g)).clamp(max=-1e-3).tolist()
    return TrainingBatch.from_samples(prompts, responses, behavior, advantages=[[s] * resp_len for s in signs])


# ------------------------------------------------------------------------------------------ model FLOPs, MFU

# Dense bf16 peak of the data sheet (no sparsity), TFLOP/s: the denominator of model-FLOP utilisation.
BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def matmul_params(shape: str, vocab: int) -> int:
    """Weights that take part in a matrix product per token: q, k, v, o, the MLP's three, and the LM head (tied
    to the embedding, but the head is still a product; the embedding lookup is not)."""
    c = SHAPES[shape]
    d, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = d // c["num_attention_heads"] * c["num_key_value_heads"]
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * inter
    return layers * per_layer + d * vocab


def train_flops(shape: str, vocab: int, seq_len: int) -> float:
    """Model FLOPs of one training step on one sequence of `seq_len` tokens (PaLM, Chowdhery et al. 2022,
    appendix B: 6N per token plus attention): 6 N T for the products (forward 2 N T, backward 4 N T), plus
    attention's QK^T and AV, causal so half the T x T scores: forward 2 x 2 x d x T^2 / 2 per layer, x3 for
    training = 6 L d T^2. Recomputation by checkpointing is not counted (model FLOPs, not hardware FLOPs)."""
    c = SHAPES[shape]
    return 6.0 * matmul_params(shape, vocab) * seq_len + 6.0 * c["num_hidden_layers"] * c["hidden_size"] * seq_len**2


def bf16_peak_tflops(device_name: str) -> float:
    """The data-sheet peak for a device name such as 'NVIDIA H200', or nan if the table lacks it."""
    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in device_name), float("nan"))


# --------------------------------------------------------------------------------------------- timing helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


@dataclass
class Phases:
    """Seconds of one instrumented step, split by synchronising around backward and the optimizer."""

    fwd: float = 0.0
    bwd: float = 0.0
    opt: float = 0.0


@dataclass
class Result:
    shape: str
    variant: str
    resp_len: int
    micro_batch: int
    grad_ckpt: bool
    samples_per_step: int
    steps_timed: int
    s_per_step: float = float("nan")
    resp_tok_s: float = float("nan")
    total_tok_s: float = float("nan")
    model_tflops: float = float("nan")
    peak_gib: float = float("nan")
    phases: dict = field(default_factory=dict)
    setup_s: float = float("nan")
    first_loss: float = float("nan")
    """Loss of the first warm-up step: the three variants must agree (same data, same initial weights)."""
    error: str = ""

