"""vLLM's KV events keyed in the router's key space (KeyTranslator), on events built as vLLM
builds them; the engine's own events are in test_vllm_instance.py."""
from __future__ import annotations

from vllm_required import require_vllm

from kvtier.frontend.cache_events import CacheEventLog
from kvtier.keys import KeyNamespace
from kvtier.policies import CacheEventKind, CacheTier
from kvtier.vllm_engine.kv_events import KeyTranslator

require_vllm()

PAGE = 4
KEYS = KeyNamespace("m")


def stored(hashes, parent, tokens, medium=None, extra_keys=None, block_size=PAGE):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=block_size, lora_id=None, medium=medium, lora_name=None,
                       extra_keys=extra_keys)


def translated(*events):
    """(translator, what its log drained: [(kind, tier, page_hashes), ...])."""
    from vllm.distributed.kv_events import KVEventBatch

    translator = KeyTranslator(KEYS, PAGE, CacheEventLog("i"))
    translator.feed(KVEventBatch(ts=0.0, events=list(events)))
    batch = translator.log.drain()
    got = [] if batch is None else [(e.kind, e.tier, e.page_hashes) for e in batch.events]
    return translator, got


def test_a_chain_over_several_events_is_keyed_as_its_whole_prefix():
    tokens = list(range(12))
    _, got = translated(stored([11, 12], None, tokens[:8]), stored([13], 12, tokens[8:]))
    assert got == [(CacheEventKind.STORED, CacheTier.DEVICE,
                    tuple(KEYS.page_hashes(tokens, PAGE)))]


def test_the_salt_among_a_first_blocks_extra_keys_seeds_its_chain():
    tokens = list(range(8))
    _, got = translated(stored([1, 2], None, tokens, extra_keys=[("tenant",), None]))
    assert got[0][2] == tuple(KEYS.page_hashes(tokens, PAGE, "tenant"))
    assert got[0][2] != tuple(KEYS.page_hashes(tokens, PAGE))


def test_removed_blocks_and_a_clear_evict_and_mediums_name_tiers():
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    tokens = list(range(8))
    keys = tuple(KEYS.page_hashes(tokens, PAGE))
    _, got = translated(stored([1, 2], None, tokens, medium="CPU"),
                        BlockRemoved(block_hashes=[2], medium="CPU"))
    assert got == [(CacheEventKind.STORED, CacheTier.HOST, keys[:1]),
                   (CacheEventKind.EVICTED, CacheTier.HOST, keys[1:])]
    _, got = translated(stored([1, 2], None, tokens), AllBlocksCleared())
    assert got == [(CacheEventKind.EVICTED, CacheTier.DEVICE, tuple(sorted(keys)))]


def test_blocks_it_cannot_key_are_skipped_and_counted():
    translator, got = translated(stored([5], 99, [1, 2, 3, 4]),  # parent never seen
                                 stored([6], None, [1, 2, 3, 4, 5, 6, 7, 8], block_size=8))
    assert got == [] and translator.skipped_blocks == 2


def test_the_connectors_l2_and_l3_changes_reach_the_router_in_its_key_space():
    """KvtierConnector.take_events: pages HELD in L2 are stored on medium CPU, pages STORED
    in L3 on STORAGE, evicted ones removed; keyed by the connector's own namespace (the
    engine's block identity), they come out in the router's (`KEYS`), salt included."""
    from kvtier.connector.l2_index import L2Change, L2ChangeKind, PageOrigin
    from kvtier.connector.vllm_connector import connector_events

    own = KeyNamespace("vllm-block-identity", layout_fingerprint="cpu")
    tokens = list(range(12))
    theirs = own.page_hashes(tokens, PAGE, salt="t")
    origins = [PageOrigin(tuple(tokens[i * PAGE:(i + 1) * PAGE]),
                          theirs[i - 1] if i else None, "t") for i in range(3)]
    held = [L2Change(L2ChangeKind.HELD, k, o) for k, o in zip(theirs, origins)]
    events = connector_events([*held[:2], L2Change(L2ChangeKind.STORED, theirs[0], origins[0]),
                               held[2], L2Change(L2ChangeKind.EVICTED, theirs[2], None)], PAGE)
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored", "BlockStored",
                                                 "BlockRemoved"]
    assert len(events[0].block_hashes) == 2  # one chain, one event
    _, got = translated(*events)
    want = KEYS.page_hashes(tokens, PAGE, "t")
    assert got == [(CacheEventKind.STORED, CacheTier.HOST, tuple(want[:2])),
                   (CacheEventKind.STORED, CacheTier.STORAGE, tuple(want[:1])),
                   (CacheEventKind.EVICTED, CacheTier.HOST, tuple(want[2:]))]


def test_blocks_keyed_by_more_than_their_tokens_and_salt_are_skipped():
    """A multimodal item's block (an (identifier, offset) pair among its extra keys) or one of
    prompt embeddings (a digest) is not the block of its tokens: neither it nor what chains
    from it is indexed; a salted block is, under its salt's chain."""
    tokens = list(range(8))
    translator, got = translated(stored([21, 22], None, tokens, extra_keys=[None, ("img", 0)]),
                                 stored([23], 22, tokens[:4]),
                                 stored([24], None, tokens[:4], extra_keys=[(b"digest",)]))
    assert got == [] and translator.skipped_blocks == 4
    _, salted = translated(stored([31], None, tokens[:4], extra_keys=[("tenant",)]))
    assert salted == [(CacheEventKind.STORED, CacheTier.DEVICE,
                       tuple(KEYS.page_hashes(tokens[:4], PAGE, "tenant")))]
