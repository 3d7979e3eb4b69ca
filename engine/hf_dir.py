"""A local Hugging Face model directory as a weight source: config.json, safetensors weights
(one file or shards with an index), tokenizer.json and the chat template.

Supported: Llama-architecture causal LMs (`LlamaForCausalLM`, `MistralForCausalLM` without a
sliding window, `Qwen2ForCausalLM` with its q/k/v biases) with SiLU MLPs, plain RoPE and
full attention. Anything else is refused, naming the setting, before a weight is read.
`digest()` identifies the weights themselves (a SHA-256 over the safetensors files), so two
checkpoints of one architecture never share cache pages.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.engine.model_config import ModelConfig
from kvtier.engine.tokenizer import SpecialTokens, Tokenizer
from kvtier.engine.weight_digest import weights_digest
from kvtier.errors import ConfigError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class HFModelDir:
    """A model directory; each method reads what it needs (ranks call them in their process)."""

    path: str

    @property
    def root(self) -> Path:
        root = Path(self.path).expanduser()
        if not (root / "config.json").is_file():
            raise ConfigError(f"{self.path}: no config.json; give a Hugging Face model "
                              f"directory (config.json, *.safetensors, tokenizer.json)")
        return root

    def _json(self, name: str, required: bool = True) -> dict[str, Any]:
        path = self.root / name
        if not path.is_file():
            if required:
                raise ConfigError(f"{self.path}: {name} is missing")
            return {}
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return data

    # ---- architecture ------------------------------------------------------------------------
    def config(self) -> ModelConfig:
        c = self._json("config.json")
        arch = (c.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise ConfigError(f"{self.path}: architecture {arch!r} is not supported; kvtier "
                              f"runs {', '.join(ARCHITECTURES)}")
        qwen2 = arch == "Qwen2ForCausalLM"
        sliding = c.get("use_sliding_window", False) if qwen2 else c.get("sliding_window")
        if sliding:
            raise ConfigError(f"{self.path}: the config asks for sliding-window attention "
                              f"(sliding_window={c.get('sliding_window')}), which kvtier does "
                              f"not run yet; use a full-attention checkpoint")
        rope = c.get("rope_parameters") or {}
        rope_type = (c.get("rope_scaling") or {}).get("rope_type") or rope.get("rope_type")
        if c.get("rope_scaling") or rope_type not in (None, "default"):
            raise ConfigError(f"{self.path}: RoPE scaling ({rope_type or c.get('rope_scaling')})"
                              f" is not supported; kvtier runs plain RoPE")
        if c.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{self.path}: hidden_act {c.get('hidden_act')!r} is not "
                              f"supported; kvtier runs SiLU (SwiGLU) MLPs")
        if c.get("mlp_bias") or (c.get("attention_bias") and not qwen2):
            raise ConfigError(f"{self.path}: biases on the MLP or the attention output "
                              f"(mlp_bias / attention_bias) are not supported")

        def need(key: str) -> Any:
            if key not in c:
                raise ConfigError(f"{self.path}: config.json lacks {key}")
            return c[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        return ModelConfig(
            hidden_size=hidden, num_layers=int(need("num_hidden_layers")), num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            rope_theta=float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position=int(c.get("max_position_embeddings", 2048)),
            name=self.root.resolve().name, attention_bias=qwen2)

    # ---- weights -------------------------------------------------------------------------------
    def weight_files(self) -> list[Path]:
        root = self.root
        index = root / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(self._json(index.name).get("weight_map", {}).values()))
            files = [root / s for s in shards]
        else:
            files = sorted(root.glob("*.safetensors"))
        missing = [f.name for f in files if not f.is_file()]
        if not files or missing:
            raise ConfigError(f"{self.path}: safetensors weights missing "
                              f"({', '.join(missing) or 'no *.safetensors file'})")
        return files

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint, by HF name (a tied LM head is dropped)."""
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for path in self.weight_files():
            state.update(load_file(str(path)))
        if self.config().tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def identity(self) -> str:
        """The model part of a cache namespace: its name and the first 16 hex digits of
        `digest()`, so two checkpoints of one architecture never share a page key."""
        return f"{self.config().name}-{self.digest()[:16]}"

    def digest(self) -> str:
        """SHA-256 over the weight files (names and bytes): the checkpoint's identity. A
        rank checks it against the driver's, then names its cache by it (`identity`), and a
        checkpoint is hundreds of MB: hashed once per host (engine/weight_digest.py), and
        asked of the host's cache once per object."""
        known = self.__dict__.get("_digest")
        if known is None:
            known = weights_digest(self.weight_files())
            self.__dict__["_digest"] = known  # frozen: not a field
        return known

    # ---- tokenizer -----------------------------------------------------------------------------
    def tokenizer(self) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        from kvtier.engine.chat_template import ChatTemplate

        root = self.root
        if not (root / "tokenizer.json").is_file():
            raise ConfigError(f"{self.path}: tokenizer.json is missing")
        backend = Backend.from_file(str(root / "tokenizer.json"))
        tc = self._json("tokenizer_config.json", required=False)
        gen = self._json("generation_config.json", required=False)
        names = {k: _token_text(tc.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                     "pad_token")}
        names = {k: v for k, v in names.items() if v is not None}

        def ids(value: Any) -> list[int]:
            return [int(v) for v in (value if isinstance(value, list) else [value])
                    if v is not None]

        eos = ids(gen.get("eos_token_id")) or ids(self._json("config.json").get("eos_token_id"))
        if not eos and "eos_token" in names:
            eos = ids(backend.token_to_id(names["eos_token"]))
        if not eos:
            raise ConfigError(f"{self.path}: no end-of-sequence token (eos_token_id in "
                              f"generation_config.json or config.json, or eos_token)")
        bos = backend.token_to_id(names["bos_token"]) if "bos_token" in names else None
        specials = tuple(t.content for t in backend.get_added_tokens_decoder().values()
                         if t.special)
        special = SpecialTokens(bos_token_id=bos, eos_token_id=eos[0], stop_token_ids=tuple(eos),
                                special_tokens=specials)
        source = _chat_template(root, tc)
        return Tokenizer(backend, special, ChatTemplate(source, names) if source else None)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(root: Path, tc: dict[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (the default one when
    it lists several by name), else None (ChatML)."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = tc.get("chat_template")
    if isinstance(template, list):
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = by_name.get("default")
    return template if isinstance(template, str) else None
