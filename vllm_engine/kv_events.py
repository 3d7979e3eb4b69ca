"""vLLM's KV events as kvtier's cache events: what a vLLM instance tells the router about the
blocks its prefix cache holds (kvtier.frontend.cache_events), in the router's key space.

vLLM publishes a `KVEventBatch` per step on ZMQ when `kv_events_config` enables it: blocks
stored (with their tokens and the parent block's hash), blocks removed, everything cleared.
Its block hashes are not kvtier's page keys, so `KeyTranslator` computes each stored block's
key once, by kvtier's chain over its tokens from its parent's key (`kvtier.keys.page_hashes`
with `prior`), remembers vLLM's hash -> key, and records the changes in a `CacheEventLog`.
A block whose parent it never saw (published before it listened, or forgotten) cannot be
keyed and is skipped, as is a block keyed by more than its tokens and cache salt (a LoRA
adapter, a multimodal item, prompt embeddings), and every block after it: the router's index
is approximate, a missing page costs a worse choice, a wrong one never wrong KV.

`EventFeed` is the subscriber: it binds a SUB socket on 127.0.0.1 (a free port) and vLLM's
publisher connects to it (vLLM connects to any endpoint without a wildcard), so every engine
publishes on its own loopback endpoint and nothing listens on other interfaces.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

from kvtier.frontend.cache_events import CacheEventLog
from kvtier.keys import KeyNamespace, page_hashes
from kvtier.policies import CacheEventKind, CacheTier

LOOPBACK = "127.0.0.1"
MAX_KEYS = 1 << 18  # vLLM hash -> key pairs kept (least recently stored forgotten first)
# vLLM's medium names (vllm.distributed.kv_events: MEDIUM_GPU, ...); None: the engine's own
MEDIUM_TIERS = {None: CacheTier.DEVICE, "GPU": CacheTier.DEVICE, "CPU": CacheTier.HOST,
                "STORAGE": CacheTier.STORAGE}


class KeyTranslator:
    """vLLM's KV events of one engine into `log`, keyed as `keys` keys pages of `page_size`
    tokens (the router's namespace; a request's `cache_salt` seeds its chain)."""

    def __init__(self, keys: KeyNamespace, page_size: int, log: CacheEventLog) -> None:
        self.keys, self.page_size, self.log = keys, page_size, log
        self._key_of: OrderedDict[Any, str] = OrderedDict()
        self._device: set[str] = set()  # keys in vLLM's prefix cache, for AllBlocksCleared
        self.skipped_blocks = 0  # stored blocks that could not be keyed

    def feed(self, batch: Any) -> None:
        """One `KVEventBatch`."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event.block_hashes, event.medium)
            elif isinstance(event, AllBlocksCleared):
                self.log.record(CacheEventKind.EVICTED, CacheTier.DEVICE, sorted(self._device))
                self._device.clear()

    def _stored(self, event: Any) -> None:
        tier = MEDIUM_TIERS.get(event.medium)
        if tier is None or event.block_size != self.page_size or event.lora_name \
                or not _keyed_by_tokens(event.extra_keys) \
                or len(event.token_ids) != len(event.block_hashes) * self.page_size:
            self.skipped_blocks += len(event.block_hashes)
            return
        if event.parent_block_hash is None:
            seed, prior = self.keys.chain_seed(_salt(event.extra_keys)), None
        else:
            seed, prior = None, self._key_of.get(event.parent_block_hash)
            if prior is None:
                self.skipped_blocks += len(event.block_hashes)
                return
        keys = page_hashes(event.token_ids, self.page_size, seed=seed, prior=prior)
        for vllm_hash, key in zip(event.block_hashes, keys):
            self._key_of.pop(vllm_hash, None)
            self._key_of[vllm_hash] = key
        while len(self._key_of) > MAX_KEYS:
            self._key_of.popitem(last=False)
        if tier is CacheTier.DEVICE:
            self._device.update(keys)
        self.log.record(CacheEventKind.STORED, tier, keys)

    def _removed(self, hashes: Sequence[Any], medium: str | None) -> None:
        tier = MEDIUM_TIERS.get(medium)
        keys = [self._key_of[h] for h in hashes if h in self._key_of]
        if tier is None or not keys:
            return
        if tier is CacheTier.DEVICE:
            self._device.difference_update(keys)
        self.log.record(CacheEventKind.EVICTED, tier, keys)


def _keyed_by_tokens(extra_keys: Sequence[Any] | None) -> bool:
    """Whether blocks with these extra keys are keyed by their tokens and cache salt alone
    (vLLM publishes a salt as a string; a multimodal item as a tuple, prompt embeddings as
    bytes: pages keyed by those are not the pages of their tokens, and are skipped)."""
    return all(isinstance(key, str) for keys in extra_keys or () if keys for key in keys)


def _salt(extra_keys: Sequence[Any] | None) -> str:
    """The cache_salt among a first block's extra keys (vLLM puts it there as a string)."""
    first = (extra_keys or [None])[0] or ()
    salts = [k for k in first if isinstance(k, str)]
    return salts[0] if salts else ""


class EventFeed:
    """A SUB socket on 127.0.0.1 that one engine's publisher connects to (`endpoint`)."""

    def __init__(self) -> None:
        import zmq

        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        port = self._sub.bind_to_random_port(f"tcp://{LOOPBACK}")
        self.endpoint = f"tcp://{LOOPBACK}:{port}"
        self.last_seq = -1
        self.missed = 0  # batches lost between two received (sequence numbers skipped)

    def take(self) -> list[Any]:
        """Every `KVEventBatch` received so far, without waiting."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        out = []
        while True:
            try:
                _topic, seq_bytes, payload = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            seq = int.from_bytes(seq_bytes, "big")
            self.missed += max(0, seq - self.last_seq - 1)
            self.last_seq = seq
            out.append(decoder.decode(payload))

    def close(self) -> None:
        self._sub.close(linger=0)
