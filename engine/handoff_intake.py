"""The decode side's KV-ready check and adoption of a handed-off request.

A decode request arrives with its prompt's KV already written into pages this rank reserved
(`IncomingKV`). Admission asks `arrived` (does every page's xxh3 match what its prefill rank
sent?) and puts the answer into the step's agreement as the slot's usable length: the whole
prompt or nothing. The MIN over the ranks is KV-ready: every rank adopts (`adopt` with the
whole prompt), or every rank drops the received pages and recomputes the request from its
prompt, so no rank ever decodes over a page another rank lacks or holds corrupt.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

from kvtier.engine.request import CachedTokens, Request, Resume
from kvtier.tiers.cache_types import CacheLookup, RequestLengths
from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)


class IntakeCounters(NamedTuple):
    adopted: int          # requests that decoded from received KV
    recomputed: int       # requests whose received KV some rank found incomplete or corrupt
    pages_verified: int   # received pages whose sum matched on this rank
    pages_corrupt: int    # received pages whose sum did not match on this rank


class HandoffIntake:
    """Verifies received pages (once per request) and adopts them into a request."""

    def __init__(self, cache: HierarchicalCache) -> None:
        self.cache = cache
        self._verdicts: dict[str, bool] = {}  # handoff id -> its pages matched on this rank
        self._counts = {name: 0 for name in IntakeCounters._fields}

    def arrived(self, req: Request) -> bool:
        """Every received page's sum equals its prefill rank's (checked once, remembered).
        Staged head objects (another TP size) that match are copied into the L1 pages; the
        staging pages are freed either way."""
        incoming = req.incoming
        assert incoming is not None
        verdict = self._verdicts.get(incoming.handoff_id)
        if verdict is None:
            if incoming.staged:
                got = self._staged(req)
            else:
                got = self.cache.exchange.l1_sums(incoming.pages)
            bad = sum(a != b for a, b in zip(got, incoming.sums))
            verdict = bad == 0 and len(incoming.sums) == len(got) > 0
            self._counts["pages_verified"] += len(got) - bad
            self._counts["pages_corrupt"] += bad
            if not verdict:
                log.warning("hand-off %s: %d of %d received pages do not match their sums; "
                            "the request is recomputed", incoming.handoff_id,
                            max(bad, 1), len(incoming.pages))
            self._verdicts[incoming.handoff_id] = verdict
        return verdict

    def _staged(self, req: Request) -> tuple[int, ...]:
        """Sums of the staged head objects; when all match, the pages go to L1. The staging
        pages are given back here."""
        incoming, cache = req.incoming, self.cache
        heads = range(cache.spec.num_kv_heads)
        got = cache.exchange.l2_head_sums(incoming.staged, heads)
        if got == incoming.sums:
            cache.exchange.copy_to_l1(incoming.staged, incoming.pages)
        cache.release_host_pages(incoming.staged)
        req.incoming = incoming._replace(staged=())
        return got

    def adopt(self, req: Request, lookup: CacheLookup, agreed_usable: int) -> bool:
        """KV-ready: the request decodes from its second token over the received pages when
        every rank had them all (`agreed_usable` is the whole prompt); else they are freed
        and the request waits to be computed from its prompt. Either way it is no longer a
        hand-off. True when adopted."""
        incoming = req.incoming
        assert incoming is not None
        self._verdicts.pop(incoming.handoff_id, None)
        req.incoming = None
        n = len(req.prompt)
        if agreed_usable < n:
            self.cache.abort(lookup, incoming.pages)
            self._counts["recomputed"] += 1
            log.warning("hand-off %s: a decode rank lacks its KV; recomputing request %d",
                        incoming.handoff_id, req.id)
            # Its first token is the prefill side's (a client may have it): it goes on after
            # it, with the prompt's KV and that token's recomputed (also in deterministic
            # mode, where a prefill instance of another TP size may not match bit for bit).
            first = (incoming.first_logprob,) if incoming.first_logprob is not None else None
            req.continue_after(Resume((incoming.first_token,), first), fold=True)
            return False
        now = time.perf_counter()
        req.adopt(lookup, list(incoming.pages))
        req.lengths, req.cached = RequestLengths(0, 0, 0, 0, 0), CachedTokens(0, 0, 0)
        req.sampler.resume(incoming.first_token, incoming.first_logprob)
        req.append(incoming.first_token)
        req.admitted_s = req.admitted_s or now
        req.kv_ready_s = now
        self._counts["adopted"] += 1
        return True

    def forget(self, handoff_id: str) -> None:
        """The request was aborted before adoption: drop its verdict."""
        self._verdicts.pop(handoff_id, None)

    @property
    def counters(self) -> IntakeCounters:
        return IntakeCounters(**self._counts)
