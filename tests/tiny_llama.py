"""A tiny random Llama checkpoint in a Hugging Face model directory (made with transformers,
SmolLM2's tokenizer.json): 2 layers, 2 KV heads."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kvtier.engine.weights import ensure_converted


def make_checkpoint(path: Path, seed: int = 0, head_dim: int = 16) -> Path:
    """`head_dim` 32 or more for vLLM's CPU attention (it has no kernel for 16)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=head_dim,
                                      vocab_size=49152, max_position_embeddings=2048,
                                      rms_norm_eps=1e-5, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    shutil.copy(ensure_converted() / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return path
