"""What keys a vLLM request's pages: everything besides its token ids that changes their KV,
read off vLLM's `Request` (kvtier.keys.PageInputs), or why nothing can (`Unkeyed`).

- the cache salt (`cache_salt`): a tenant's chain of its own;
- the LoRA adapter: its name and a digest of its files (`adapter_config.json` and the
  weights), so an adapter re-pointed at other weights under the same name is another key;
  an adapter whose files the EngineCore process cannot read (a hub id resolved elsewhere)
  cannot be keyed;
- each multimodal item: vLLM's identifier of it (a digest of the item's content, or the
  caller's `multi_modal_uuids`, which vLLM's own prefix cache trusts likewise), on every page
  its placeholder tokens touch;
- prompt embeddings: a digest of each full page's rows.
See docs/vllm.md, "What a page's key covers".
"""
from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvtier.connector.scheduler_side import Unkeyed
from kvtier.keys import PageInputs, PlacedItem

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_CHUNK = 1 << 22


class AdapterDigests:
    """Digests of LoRA adapter directories, kept per directory while its files' names, sizes
    and modification times stay as they were (an adapter is hashed once, not per request)."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple, str]] = {}  # real path -> (file stamps, digest)
        self._lock = threading.Lock()

    def identity(self, name: str, path: str) -> str | None:
        """`name` and the digest of the adapter files under `path`; None when `path` is not
        a readable local directory."""
        try:
            root = Path(path).expanduser().resolve()
            files = sorted(p for p in root.iterdir() if p.is_file())
            stamps = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
        except OSError:
            return None
        if not files:
            return None
        with self._lock:
            known = self._known.get(str(root))
        if known is not None and known[0] == stamps:
            return f"{name}@{known[1]}"
        h = hashlib.sha256()
        try:
            for p in files:
                h.update(p.name.encode() + b"\0")
                with p.open("rb") as fh:
                    while chunk := fh.read(_CHUNK):
                        h.update(chunk)
        except OSError:
            return None
        digest = h.hexdigest()[:32]
        with self._lock:
            self._known[str(root)] = (stamps, digest)
        return f"{name}@{digest}"


def page_inputs(request: "Request", page_size: int,
                adapters: AdapterDigests) -> PageInputs | Unkeyed:
    """What keys `request`'s pages of `page_size` tokens (module docstring)."""
    adapter = ""
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        found = adapters.identity(str(lora.lora_name), str(lora.lora_path or ""))
        if found is None:
            log.warning("LoRA adapter %s (%s) is not a readable local directory here: its "
                        "requests neither load nor save pages", lora.lora_name, lora.lora_path)
            return Unkeyed.ADAPTER
        adapter = found
    items = []
    for feature in getattr(request, "mm_features", None) or ():
        identifier = getattr(feature, "identifier", None)
        if not identifier:
            return Unkeyed.MULTIMODAL
        position = feature.mm_position
        items.append(PlacedItem(str(identifier), int(position.offset), int(position.length)))
    items.sort(key=lambda item: item.offset)
    return PageInputs(getattr(request, "cache_salt", None) or "", adapter, tuple(items),
                      embeds_digests(getattr(request, "prompt_embeds", None), page_size))


def embeds_digests(embeds: "torch.Tensor | None", page_size: int) -> tuple[bytes, ...]:
    """A digest of each full page's rows of a `[tokens, hidden]` prompt embedding tensor (none:
    no embeddings)."""
    if embeds is None:
        return ()
    rows = embeds.detach().to("cpu").contiguous()
    raw = rows.view(rows.shape[0], -1).view(torch.uint8).numpy()
    return tuple(hashlib.sha256(raw[p * page_size:(p + 1) * page_size].tobytes()).digest()
                 for p in range(rows.shape[0] // page_size))
