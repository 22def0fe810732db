"""Test fixtures built locally: tiny random-weight Llama / Qwen3 folders with a small byte-level
BPE tokenizer, and helpers to run the engine and HF transformers side by side."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog", "speculative decoding drafts a block of tokens",
    "def add(a, b):\n    return a + b\n", "Paris is the capital of France.", "1 + 1 = 2, 2 + 2 = 4",
] * 20


def build_tokenizer(folder: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def tiny_config(kind: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if kind == "llama":
        cfg = LlamaConfig(**{**common, "rope_theta": 10000.0,
                             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                             **overrides})
    elif kind == "qwen3":
        cfg = Qwen3Config(**{**common, "rope_theta": 1000000.0, **overrides})
    else:
        raise ValueError(kind)
    cfg.architectures = ["LlamaForCausalLM" if kind == "llama" else "Qwen3ForCausalLM"]
    return cfg


def build_tiny_model(folder: Path, kind: str, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    cfg = tiny_config(kind, len(tok), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights give peaked, tie-free distributions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return folder


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
