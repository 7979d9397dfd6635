"""Tiny random-weight Qwen3 / Qwen3-MoE checkpoints with a locally trained tokenizer.

No model hub is reachable: everything is built here with transformers and tokenizers.
"""

from __future__ import annotations

import os

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "decode graphs replay captured kernels on the gpu",
    "mixture of experts layers route each token to a few experts",
    "paged attention reads keys and values from blocks in the cache",
    "hello world, this is a tiny tokenizer for tests",
] * 20


def build_tokenizer(path: str, vocab_size: int = 384) -> int:
    """Train a byte-level BPE tokenizer on CORPUS and save it (HF format). Returns vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)
    return len(fast)


def build_checkpoint(path: str, moe: bool = False, seed: int = 0, head_dim: int = 32,
                     max_positions: int = 512) -> str:
    """Save a tiny Qwen3 (or Qwen3-MoE) checkpoint with tokenizer into `path` (head_dim 64 or
    128 for one the plugin's attention kernels take; `max_positions` its context length)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.makedirs(path, exist_ok=True)
    vocab = build_tokenizer(path)
    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=max_positions,
                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if moe:
        cfg = Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                             num_experts_per_tok=2, decoder_sparse_step=1, **common)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        cfg = Qwen3Config(intermediate_size=128, **common)
        model = Qwen3ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    return path
