"""Pinned prefixes, every side of the feature: a rank's pin desk, the pin on every TP rank of
an instance, and the ingress's `POST`, `DELETE` and `GET /admin/pin`.

- Rank desk (`RankPinDesk`): the pinned-prefix calls over one rank's cache pins
  (tiers/cache_pins). `Rank` (actors/rank_actor) owns one and its remote pin calls delegate
  here. Every rank of an instance gets the same calls in the same order (`pin_on_instance`);
  answers are values, never exceptions, since an exception in a rank call counts as a rank
  fault.
- Instance (`pin_on_instance`): the same pages pinned on every TP rank. The ranks' MIN
  agreement copes with ranks that hold different pages, but a pin must not make them differ
  on its own: a page pinned on one rank and evictable on another would be kept there and lost
  here. So the instance asks every rank how many whole pages of the prefix it holds, pins
  that MIN on each, and unpins everywhere if any rank refuses (its share of L2 for pins is
  used up). Then every rank's L2->L3 backups finish, so the L3 namespace has published the
  pinned pages before it is asked to pin them. Runs in the instance's driver thread, between
  steps (`InstanceServer.call`).
- Serve (`PinDesk`): a prefix's whole pages are hashed as its requests' pages are (the
  instances' key namespace, the request's salt); when no instance holds all of them and L3
  does not either, it is prefilled first (a request with one output token, routed like any
  other); then every instance that holds it pins it on all its ranks (`pin_on_instance`) and
  the L3 namespace pins its published pages. A refusal anywhere (pinned pages past their
  share) undoes the instances' pins and answers 409 with the room missing. The body rules,
  the pin's id and the listing's shape are Ray-free (kvtier.frontend.pins); every Ray call of the
  feature is here or in the deployments it calls.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence, TypeVar

from kvtier.actors.l3.namespace_actor import NamespaceClient
from kvtier.actors.serve_answer import RoutedAnswer, RouterStates
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import PinRoomError
from kvtier.keys import KeyNamespace
from kvtier.messages import pack_record, pack_records, unpack_record, unpack_records
from kvtier.frontend.openai_requests import ApiError, ApiLimits, check_prompt_tokens
from kvtier.frontend.pins import PinBody, PinVerb, merge_pins, parse_pin_body, pin_id
from kvtier.frontend.records import ReplicaDescription, ReplicaStorage, Route
from kvtier.frontend.settings import ServeSettings
from kvtier.frontend.tenants import request_salt
from kvtier.tiers.cache_pins import PinListing, PinOutcome, PinRefusal
from kvtier.tiers.hierarchical_cache import HierarchicalCache

if TYPE_CHECKING:  # a name only: actors/instance imports the rank actor, which imports this
    from kvtier.actors.instance import Instance

log = logging.getLogger(__name__)
T = TypeVar("T")


# ==== rank desk: one rank's pins ============================================================

class RankPinDesk:
    """The pins of one rank's cache; rank 0 also extends in L3 the pins hits extended."""

    def __init__(self, cache: HierarchicalCache, rank: int) -> None:
        self._cache = cache
        self._pins = cache.pins
        self.rank = rank

    def held(self, tokens: Sequence[int], salt: str = "") -> int:
        """Whole pages of `tokens` this rank holds in L1 or L2 (the instance pins the MIN)."""
        return self._pins.held_pages([int(t) for t in tokens], salt)

    def pin(self, pin_id: str, tokens: Sequence[int], pages: int, ttl_s: float,
            max_fraction: float, salt: str = "", tenant: str = "") -> bytes:
        """Pin the first `pages` whole pages: a PinOutcome record, or a PinRefusal record (a
        value: an exception would count as a rank fault); actors.step_wire `decode_pin`."""
        return pack_record(self._pins.pin(pin_id, [int(t) for t in tokens], pages, ttl_s,
                                          max_fraction, salt, tenant))

    def unpin(self, pin_id: str) -> bool:
        return self._pins.unpin(pin_id)

    def describe(self) -> bytes:
        """The live pins, PinListing records (`pack_records`; a read: pins past their TTL
        are left out here, dropped by the step's `refresh`)."""
        return pack_records(p for p in self._pins.describe() if p.expires_in_s > 0)

    def figures(self) -> dict:
        """The pins' figures, for metrics (a read)."""
        _, device, host = self._pins.pinned_pages()
        return {"pins": len(self._pins), "device_pages": device, "host_pages": host}

    def refresh(self) -> None:
        """The step's pin upkeep: drop expired pins; rank 0 extends in L3 the pins that hits
        here extended (a hit in L2 never asks L3)."""
        self._pins.expire()
        refreshed = self._pins.take_refreshed()
        if refreshed and self.rank == 0:
            try:
                self._cache.extend_l3_pins(refreshed)
            except Exception as exc:  # noqa: BLE001 - the L3 pin lapses at its TTL at worst
                log.warning("extending %d L3 pins failed (%s)", len(refreshed), exc)


# ==== instance: the same pages pinned on every TP rank ======================================

class InstancePin(NamedTuple):
    """One instance's answer to a pin (a msgpack record from its deployment): the pages
    pinned on every rank (0: the instance does not hold the prefix), or the refusal of the
    rank short of most room."""

    instance: str
    outcome: PinOutcome | None = None  # rank 0's (every rank pinned the same pages)
    refused: PinRefusal | None = None

    @property
    def pages(self) -> int:
        """Pages pinned on every rank (0: not held, or refused)."""
        return self.outcome.pages if self.outcome is not None else 0


def pin_on_instance(inst: Instance, name: str, pin_id: str, tokens: Sequence[int], salt: str,
                    ttl_s: float, max_fraction: float, tenant: str) -> InstancePin:
    """Pin the prefix on every rank of `inst` (all or none)."""
    tokens = [int(t) for t in tokens]
    ranks = inst.rank_group
    held = min(ranks.pin_held(tokens, salt))
    if held == 0:
        return InstancePin(name)
    outs = ranks.pin(pin_id, tokens, held, ttl_s, max_fraction, salt, tenant)
    refused = [out for out in outs if isinstance(out, PinRefusal)]
    if refused:
        ranks.unpin(pin_id)
        return InstancePin(name, refused=max(refused,
                                             key=lambda r: r.needed_pages - r.free_pages))
    inst.quiesce()  # backups written and reported: the namespace publishes the pinned pages
    return InstancePin(name, outs[0])


# ==== serve: the ingress's /admin/pin =======================================================

CALL_TIMEOUT_S = 120.0
PREFILL_SAMPLING = SamplingParams(max_new_tokens=1, temperature=0.0)


class PinDesk:
    """Answers the pin endpoints: `handle(verb, body)` -> (HTTP status, JSON body)."""

    def __init__(self, router: Any, instances: dict[str, Any], states: RouterStates,
                 settings: ServeSettings, tokenizer: Any, limits: ApiLimits,
                 check_s: float) -> None:
        self.router, self.instances, self.states = router, instances, states
        self.settings, self.tokenizer, self.limits = settings, tokenizer, limits
        self.check_s = check_s
        self._keys: tuple[KeyNamespace, int] | None = None

    async def handle(self, verb: PinVerb, raw: bytes = b"") -> tuple[int, dict]:
        try:
            if verb is PinVerb.LIST:
                return 200, {"pins": await self.list()}
            body = parse_pin_body(raw, verb is PinVerb.UNPIN, self.settings.max_body_bytes)
            if body.pin_id:
                return await self.unpin(body.pin_id)
            tokens, salt = self._prefix(body)
            if verb is PinVerb.UNPIN:
                _, page = await self._key_namespace()
                return await self.unpin(pin_id(salt, tokens[: len(tokens) // page * page]))
            return 200, await self.pin(tokens, salt, body.tenant, body.ttl_s)
        except ApiError as exc:
            return exc.status, exc.to_body()
        except PinRoomError as exc:
            return 409, ApiError(409, str(exc), code="pin_does_not_fit").to_body()

    # ---- the three verbs ------------------------------------------------------------------
    async def pin(self, tokens: list[int], salt: str, tenant: str, ttl_s: float) -> dict:
        keys, page = await self._key_namespace()
        full = len(tokens) // page
        if full == 0:
            raise ApiError(400, f"the prefix is {len(tokens)} tokens, shorter than one page "
                                f"({page} tokens): a pin holds whole pages", param="tokens")
        tokens = tokens[: full * page]
        pid, hashes = pin_id(salt, tokens), keys.page_hashes(tokens, page, salt)
        namespace = await self._namespace()
        held = await self._each(lambda h: h.held.remote(tokens, salt))
        in_l3 = await self._l3(lambda c: c.lookup(namespace, hashes)) if namespace else None
        prefilled = max(held.values()) < full and (in_l3 is None or in_l3.hit_pages < full)
        if prefilled:
            await self._prefill(tokens, salt)
        fraction = self.settings.pin_max_fraction
        results = {name: unpack_record(InstancePin, raw) for name, raw in (await self._each(
            lambda h: h.pin.remote(pid, tokens, salt, ttl_s, fraction, tenant))).items()}
        refused = [r for r in results.values() if r.refused is not None]
        if refused:
            await self._each(lambda h: h.unpin.remote(pid))
            r = refused[0].refused
            raise PinRoomError(r.needed_pages, r.free_pages,
                               f"L2 of instance {refused[0].instance}", r.reason)
        l3_pages = None
        if namespace:
            try:
                l3_pages = await self._l3(lambda c: c.pin(namespace, pid, hashes, ttl_s,
                                                          fraction, tenant))
            except Exception:  # refused (409), or the namespace actor is away (503): no
                await self._each(lambda h: h.unpin.remote(pid))  # half-made pin stays behind
                raise
        log.info("pinned %d pages as %s for %.0f s (%s, L3 %s)", full, pid, ttl_s,
                 {n: r.pages for n, r in results.items()}, l3_pages)
        return {"id": pid, "tenant": tenant, "tokens": full * page, "pages": full,
                "ttl_s": ttl_s, "prefilled": prefilled,
                "instances": {n: r.pages for n, r in results.items()},
                "l3_pages": l3_pages}

    async def unpin(self, pid: str) -> tuple[int, dict]:
        found = await self._each(lambda h: h.unpin.remote(pid))
        namespace = await self._namespace()
        in_l3 = await self._l3(lambda c: c.unpin(namespace, pid)) if namespace else None
        if not any(found.values()) and not in_l3:
            raise ApiError(404, f"no pin {pid} (expired, unpinned, or never made); GET "
                                f"/admin/pin lists them", param="id")
        return 200, {"id": pid, "unpinned": {"instances": found, "l3": in_l3}}

    async def list(self) -> list[dict]:
        _, page = await self._key_namespace()
        per_instance = {name: unpack_records(PinListing, b) for name, b in
                        (await self._each(lambda h: h.pins.remote())).items()}
        namespace = await self._namespace()
        l3 = await self._l3(lambda c: c.pins(namespace)) if namespace else None
        return merge_pins(per_instance, l3, page, time.time())

    # ---- helpers --------------------------------------------------------------------------
    def _prefix(self, body: PinBody) -> tuple[list[int], str]:
        """The body's tokens (messages rendered as a chat completion renders them, without
        the assistant header it adds last, so longer conversations extend the prefix) and
        the salt its tenant's requests carry."""
        known = set(self.settings.api_keys.values())
        if body.tenant and body.tenant not in known:
            raise ApiError(400, f"tenant: {body.tenant!r} is not a tenant of this server "
                                f"(--api-keys-file names {len(known)})", param="tenant")
        if body.messages is not None:
            messages = [{"role": m.role.value, "content": m.content} for m in body.messages]
            tokens, param = self.tokenizer.encode_chat(messages, add_generation_prompt=False), \
                "messages"
        else:
            tokens, param = list(body.tokens or ()), "tokens"
        check_prompt_tokens(tokens, self.limits, self.tokenizer.vocab_size, param=param)
        return tokens, request_salt(body.tenant, body.cache_salt)

    async def _prefill(self, tokens: list[int], salt: str) -> None:
        """Compute the prefix on the instance the router picks (one output token)."""
        route = Route.from_msgpack(await self.router.choose.remote(tokens, cache_salt=salt))
        answer = RoutedAnswer(self.router, self.instances, self.states, tokens,
                              PREFILL_SAMPLING, route.instance, self.check_s,
                              cache_salt=salt)
        async for _ in answer.items():
            pass

    async def _each(self, call: Callable[[Any], Any]) -> dict[str, Any]:
        """`call(handle)` on every instance at once; results by instance name."""
        names = list(self.instances)
        results = await asyncio.wait_for(
            asyncio.gather(*(call(self.instances[n]) for n in names)), CALL_TIMEOUT_S)
        return dict(zip(names, results))

    async def _namespace(self) -> str | None:
        """The L3 namespace the instances attached (None: no L3)."""
        handle = next(iter(self.instances.values()))
        l3 = ReplicaStorage.from_msgpack(
            await asyncio.wait_for(handle.storage.remote(), CALL_TIMEOUT_S)).l3
        return None if l3 is None else l3.namespace

    async def _l3(self, call: Callable[[NamespaceClient], T]) -> T:
        """`call(client)` on the namespace actor's typed client (blocking: run off the event
        loop)."""
        def run() -> T:
            import ray

            from kvtier.actors.l3.namespace_actor import RAY_NAMESPACE
            return call(NamespaceClient(ray.get_actor(self.settings.l3_actor,
                                                      namespace=RAY_NAMESPACE)))
        return await asyncio.get_running_loop().run_in_executor(None, run)

    async def _key_namespace(self) -> tuple[KeyNamespace, int]:
        """The instances' page-key namespace and page size (built alike: any one answers)."""
        if self._keys is None:
            desc = ReplicaDescription.from_msgpack(
                await next(iter(self.instances.values())).describe.remote())
            self._keys = (desc.key_namespace, desc.page_size)
        return self._keys
