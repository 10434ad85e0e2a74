"""A tiny model for task-library data (reasoning-gym, data.format: reasoning_gym): a byte-level BPE tokenizer trained
here on the tasks' own text, and a randomly initialised Qwen2 over its vocabulary.

Any text encodes (the 256 bytes are in the vocabulary), so a question of a task no one here wrote never loses a
character, and the merges learnt from the tasks' questions and answers keep their prompts short.
"""

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL = (PAD, BOS, EOS)
"""Ids 0, 1, 2, as in the other demo tokenizers."""


def build_task_tokenizer(folder: str | Path, texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of `vocab_size` tokens (the 3 special ones, the 256 bytes, then merges) on `texts`,
    write it to `folder` and return it. Encoding puts BOS in front; decoding gives the text back."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=None, clean_up_tokenization_spaces=False, model_max_length=4096)
    fast.save_pretrained(str(folder))
    return fast


def build_task_model(folder: str | Path, texts: Iterable[str], *, vocab_size: int = 512, hidden: int = 128,
                     layers: int = 2, heads: int = 2, kv_heads: int = 1, head_dim: int = 64, intermediate: int = 256,
                     max_positions: int = 512, seed: int = 0) -> str:
    """Save the tokenizer trained on `texts` and a random fp32 Qwen2 over its vocabulary to `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_task_tokenizer(folder, texts, vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, name, getattr(config, name))
    model.save_pretrained(str(folder))
    return str(folder)


def task_texts(names: Iterable[str], size: int = 200, seed: int = 0) -> list[str]:
    """Questions and `<answer>`-tagged answers of `size` entries of each reasoning-gym dataset in `names`: the
    text the tokenizer learns its merges from."""
    import reasoning_gym

    texts = []
    for name in names:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed)
        for entry in dataset:
            texts += [entry["question"], f"<answer>{entry['answer']}</answer>"]
    return texts
