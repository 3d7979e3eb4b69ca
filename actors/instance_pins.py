"""Pinning a prefix on every TP rank of an instance: the same pages on each.

The ranks' MIN agreement copes with ranks that hold different pages, but a pin must not make
them differ on its own: a page pinned on one rank and evictable on another would be kept
there and lost here. So the instance asks every rank how many whole pages of the prefix it
holds, pins that MIN on each, and unpins everywhere if any rank refuses (its share of L2 for
pins is used up). Then every rank's L2->L3 backups finish, so the L3 namespace has published
the pinned pages before it is asked to pin them. Runs in the instance's driver thread,
between steps (`InstanceServer.call`).
"""
from __future__ import annotations

from typing import Sequence

from kvtier.actors.instance import Instance
from kvtier.tiers.cache_pins import PinRefusal


def pin_on_instance(inst: Instance, name: str, pin_id: str, tokens: Sequence[int], salt: str,
                    ttl_s: float, max_fraction: float, tenant: str) -> dict:
    """{"instance", "pages", "device_pages", "host_pages", ...}: the pages pinned on every
    rank (0: the instance does not hold the prefix), or {"instance", "refused": {
    "needed_pages", "free_pages", "reason"}} (the rank short of most room)."""
    tokens = [int(t) for t in tokens]
    ranks = inst.rank_group
    held = min(ranks.pin_held(tokens, salt))
    if held == 0:
        return {"instance": name, "pages": 0}
    outs = ranks.pin(pin_id, tokens, held, ttl_s, max_fraction, salt, tenant)
    refused = [out for out in outs if isinstance(out, PinRefusal)]
    if refused:
        ranks.unpin(pin_id)
        worst = max(refused, key=lambda r: r.needed_pages - r.free_pages)
        return {"instance": name, "refused": worst._asdict()}
    inst.quiesce()  # backups written and reported: the namespace publishes the pinned pages
    return {"instance": name, **outs[0]._asdict()}
