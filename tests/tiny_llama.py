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


def make_lora_adapter(path: Path, base: Path, seed: int, rank: int = 8) -> Path:
    """A random LoRA adapter (PEFT's files) on `q_proj` and `v_proj` of every layer of a
    checkpoint `make_checkpoint(base, head_dim=32)` made, large enough to change answers."""
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    outs = {"q_proj": config["num_attention_heads"] * head_dim,
            "v_proj": config["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in outs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) / 2
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=gen) / 2
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(outs), "bias": "none", "base_model_name_or_path": str(base)}))
    return path
