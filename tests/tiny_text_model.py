"""A tiny random Qwen2 model with a byte-level tokenizer (one token per byte) and a ChatML template,
for running real-text configs (GSM8K) through the whole stack without hub downloads."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_text_model(folder: str | Path, seed: int = 0, max_positions: int = 2048) -> str:
    # Byte-level BPE with no merges: one token per byte, in the same byte-to-unicode alphabet Qwen2's tokenizer
    # class uses (transformers picks that class from the model type, whatever tokenizer_config says).
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(SPECIALS)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    folder = Path(folder)
    fast.save_pretrained(str(folder))
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"],
                         bos_token_id=None)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(str(folder))
    return str(folder)
