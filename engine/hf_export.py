"""A Hugging Face model directory exported from a converted GGUF cache directory, for serving
engines that load one (`vllm.LLM(model=DIR)`, `transformers` `from_pretrained(DIR)`).

kvtier converts a GGUF file once (kvtier.engine.weights) into `model.safetensors` (HF Llama
names, float32), `tokenizer.json` and a `config.json` in kvtier's own format, which those engines
do not read. `ensure_hf_export` writes a real HF directory beside it, `<converted name>-hf/`:
`config.json` in HF Llama format, `tokenizer_config.json` (special tokens, the GGUF's chat
template), `generation_config.json` (bos and stop ids), and the weights and tokenizer as hard
links to the converted files (copies where linking fails; never write through them). It is
written once, atomically under the converter's lock, and again when the converted directory
was rebuilt from another GGUF (`kvtier-export.json` records what it was exported from). Only
Llama-architecture models are exported: a setting LlamaForCausalLM has no key for (Gemma-3's
architecture, q/k/v biases, ...) is refused by name.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvtier.engine.model_config import ModelConfig
from kvtier.engine.tokenizer import SpecialTokens
from kvtier.engine.weights import ensure_converted, locked, swapped_in
from kvtier.errors import ConfigError

EXPORTER_VERSION = 1  # bump when the exported files change meaning
MARKER = "kvtier-export.json"  # what the directory was exported from
HF_SUFFIX = "-hf"
TORCH_DTYPE = "bfloat16"  # SmolLM2's original dtype: what vLLM runs by default
_LINKED = ("model.safetensors", "tokenizer.json")
_WRITTEN = ("config.json", "tokenizer_config.json", "generation_config.json", MARKER)
# ModelConfig fields a LlamaForCausalLM config.json has no key for: they must keep their defaults
_LLAMA_FIXED = ("architecture", "attention_bias", "norm_style", "activation", "embed_scale",
                "attention_scale", "qk_norm", "sliding_window", "rope_local_theta")


def export_dir(converted_dir: Path) -> Path:
    """Where `converted_dir` is exported: `<name>-hf` in the same parent."""
    return converted_dir.parent / f"{converted_dir.name}{HF_SUFFIX}"


def ensure_hf_export(converted_dir: Path) -> Path:
    """The HF directory of `converted_dir` (what `ensure_converted` or `ensure_gguf_converted`
    returned), exported first when it is missing or was exported from another conversion."""
    converted = Path(converted_dir).expanduser()
    meta = _converted_meta(converted)
    marker = _marker(meta)
    target = export_dir(converted)
    if _is_current(target, marker):
        return target
    with locked(target):
        if not _is_current(target, marker):  # another process may just have exported it
            _export(converted, meta, marker, target)
    return target


def smollm2_hf_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as a HF directory (the packaged GGUF converted first if needed)."""
    return ensure_hf_export(ensure_converted(cache_dir))


def check_exportable(config: ModelConfig) -> None:
    """Refuse, naming the setting, a model a HF Llama config.json would describe wrongly."""
    defaults = {f.name: f.default for f in fields(ModelConfig)}
    for name in _LLAMA_FIXED:
        value = getattr(config, name)
        if value != defaults[name]:
            raise ConfigError(f"model {config.name!r}: {name}={getattr(value, 'value', value)!r}"
                              f" has no Hugging Face LlamaForCausalLM equivalent; only "
                              f"Llama-architecture models are exported (run this one with "
                              f"kvtier, or give the other engine its original HF directory)")


def hf_config(config: ModelConfig, special: SpecialTokens) -> dict[str, Any]:
    """config.json of a HF LlamaForCausalLM with `config`'s shapes and constants."""
    check_exportable(config)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_heads, "num_hidden_layers": config.num_layers,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position, "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu",
        "bos_token_id": special.bos_token_id, "eos_token_id": special.eos_token_id,
        "torch_dtype": TORCH_DTYPE, "attention_bias": False, "mlp_bias": False,
    }


def tokenizer_config(meta: dict[str, Any], names: dict[str, str],
                     max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by text, the GGUF's chat template (none when
    the GGUF has none), the context length."""
    template = meta.get("chat_template") or {}
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **names,
                           "model_max_length": max_length,
                           "clean_up_tokenization_spaces": False}  # decode as kvtier does
    if template.get("source"):
        out["chat_template"] = template["source"]
    return out


def generation_config(special: SpecialTokens) -> dict[str, Any]:
    """generation_config.json: bos, and every stop id as eos (vLLM stops at each)."""
    stop = list(special.stop_token_ids) or [special.eos_token_id]
    return {"bos_token_id": special.bos_token_id,
            "eos_token_id": stop if len(stop) > 1 else stop[0]}


def _converted_meta(converted: Path) -> dict[str, Any]:
    """The converted directory's own config.json, refused when it is not one."""
    try:
        meta = json.loads((converted / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{converted}: no readable config.json ({exc}); give a directory "
                          f"ensure_converted() or ensure_gguf_converted() made") from None
    if not isinstance(meta, dict) or not {"model", "tokenizer", "source"} <= meta.keys():
        raise ConfigError(f"{converted}: config.json is not a converted GGUF's (no model, "
                          f"tokenizer and source keys); give a directory ensure_converted() or "
                          f"ensure_gguf_converted() made, not a Hugging Face one")
    return meta


def _marker(meta: dict[str, Any]) -> dict[str, Any]:
    """What an export records of its conversion; another value means export again."""
    return {"exporter_version": EXPORTER_VERSION,
            "converter_version": meta.get("converter_version"), "source": meta["source"],
            "source_sha256": meta.get("source_sha256")}


def _is_current(target: Path, marker: dict[str, Any]) -> bool:
    if not all((target / name).is_file() for name in (*_LINKED, *_WRITTEN)):
        return False
    try:
        return json.loads((target / MARKER).read_text()) == marker
    except (OSError, ValueError):
        return False


def _token_names(converted: Path, meta: dict[str, Any], special: SpecialTokens
                 ) -> dict[str, str]:
    """bos_token, eos_token (the texts of the engine's ids), and unk/pad where the GGUF's chat
    template names them."""
    from tokenizers import Tokenizer as Backend

    if special.add_bos:
        raise ConfigError("the tokenizer starts every prompt with BOS (add_bos), which a "
                          "PreTrainedTokenizerFast config does not express; it is not exported")
    backend = Backend.from_file(str(converted / "tokenizer.json"))
    names = dict((meta.get("chat_template") or {}).get("special_tokens", {}))
    for key, token_id in (("bos_token", special.bos_token_id),
                          ("eos_token", special.eos_token_id)):
        if token_id is not None:
            names[key] = backend.id_to_token(token_id)
    return names


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, target)


def _export(converted: Path, meta: dict[str, Any], marker: dict[str, Any],
            target: Path) -> None:
    config = ModelConfig.from_dict(meta["model"])
    special = SpecialTokens.from_dict(meta["tokenizer"])
    files = {"config.json": hf_config(config, special),  # refuses before anything is read
             "tokenizer_config.json": tokenizer_config(
                 meta, _token_names(converted, meta, special), config.max_position),
             "generation_config.json": generation_config(special), MARKER: marker}
    with swapped_in(target) as tmp:
        for name in _LINKED:
            _link_or_copy(converted / name, tmp / name)
        for name, data in files.items():
            (tmp / name).write_text(json.dumps(data, indent=2) + "\n")
            (tmp / name).chmod(0o644)
