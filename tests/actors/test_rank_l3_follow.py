"""A rank follows its L3 namespace through the namespace actor's failures, without Ray: the
actor is an in-process service the tests "restart" (a new NamespaceService, as a new
incarnation that could not restore its state) or break (every call fails).

Whatever the actor does, a step never raises and answers stay right: L3 metadata errors are L3
misses, counted; a namespace the actor lost is registered again by the rank; pages stored
while the directory was away are published only where they are (the same storage), never in
storage the namespace came back with instead.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

import kvtier.actors.l3.rank_link as rank_link
from kvtier.actors.l3.namespace_actor import FakeNamespaceClient, NamespaceUnavailable
from kvtier.actors.l3.namespace_service import NamespaceService
from kvtier.actors.rank_actor import Rank, RankSettings, RankSnapshot
from kvtier.actors.step_wire import decode_report, encode_sampling
from kvtier.config import HiCacheConfig
from kvtier.cli.demo import namespace_spec
from kvtier.engine.request import Output
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.weight_sources import TinyWeights
from kvtier.messages import unpack_record
from kvtier.tiers.cache_types import CacheAudit

PAGE = 16
CONFIG = HiCacheConfig(page_size=PAGE, prefetch_policy="wait_complete",
                       prefetch_threshold_tokens=PAGE, load_back_threshold_tokens=PAGE)
SETTINGS = RankSettings(TinyWeights(seed=5), CONFIG, device_pages=48, dtype=torch.float32,
                        chunk_tokens=PAGE)
GREEDY = SamplingParams(max_new_tokens=3)
ANSWER_BOUND_S = 60.0  # a step may wait on an L3 read: bound the answer in time, not steps


def tokens(seed: int, n: int = 4 * PAGE + 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


class SwitchableClient(FakeNamespaceClient):
    """The namespace actor as the rank's client sees it: `down` makes every call fail as a
    dead actor's do; `restart()` swaps in a new incarnation that lost every namespace."""

    down = False

    def _call(self, method, *args):
        if self.down:
            raise NamespaceUnavailable(f"injected: the namespace actor is down ({method})")
        return super()._call(method, *args)

    def restart(self) -> None:
        self.service.close()
        self.service = NamespaceService(None)  # nothing restored


@pytest.fixture
def actor(monkeypatch):
    monkeypatch.setattr(rank_link, "L3_EPOCH_CHECK_S", 0.0)  # the rank checks at every step
    with SwitchableClient() as client:
        yield client


def rank_on(client: SwitchableClient, info) -> Rank:
    """A TP=1 rank attached to `info`, whose directory client is `client`."""
    cls = type("LocalRank", (Rank,), {"_directory": lambda self, name: client})
    return cls(0, 1, "", SETTINGS._replace(l3=info, l3_actor="in-process"))


def answer(rank: Rank, prompt: list[int]) -> Output:
    """One request through the rank's own steps (which follow the namespace)."""
    req = rank.add_request(prompt, encode_sampling(GREEDY))
    deadline = time.monotonic() + ANSWER_BOUND_S
    while time.monotonic() < deadline:
        for out in decode_report(rank.step()).finished:
            if out.request_id == req:
                return out
        if rank.engine.last_step.idle:
            time.sleep(0.001)  # waiting on an L3 read
    raise AssertionError(f"no answer within {ANSWER_BOUND_S} s")


def cold(prompt: list[int]) -> tuple[int, ...]:
    rank = Rank(0, 1, "", SETTINGS)
    try:
        return rank.engine.generate([prompt], GREEDY)[0].tokens
    finally:
        rank.close()


def from_l3(rank: Rank, prompt: list[int]) -> Output:
    """`prompt` again with L1 and L2 dropped: what it reuses comes from L3."""
    rank.drop_cache()
    return answer(rank, prompt)


def register(client, root) -> object:
    return client.register(namespace_spec(SETTINGS.source, CONFIG, "file", str(root), "tiny",
                                          "follow", dtype=SETTINGS.dtype, page_size=PAGE))


def test_a_namespace_the_actor_lost_is_registered_again_by_the_rank(actor, tmp_path):
    a, b, c = tokens(1), tokens(2), tokens(3)
    info = register(actor, tmp_path / "l3")
    rank = rank_on(actor, info)
    try:
        assert answer(rank, a).tokens == cold(a)
        rank.quiesce()
        assert from_l3(rank, a).cached.storage == 4 * PAGE

        actor.restart()  # a new incarnation without the namespace (a failed restore)
        assert actor.namespaces() == []
        misses = rank.engine.cache.storage.counters.directory_miss_lookups
        out = from_l3(rank, a)  # its lookup fails: a miss, counted, and a right answer
        assert out.tokens == cold(a) and out.cached.storage == 0
        assert rank.engine.cache.storage.counters.directory_miss_lookups == misses + 1
        # The step after it asked about the namespace and registered it again; the new
        # directory rebuilt from the files, so A's pages are hits again.
        assert actor.namespaces() == [info.namespace]
        rank.quiesce()  # the missed answer's backups end: drop_cache then empties L2 (a page
        # still being written stays, and was a host hit once in a loaded CI run)
        out = from_l3(rank, a)
        assert out.tokens == cold(a) and out.cached.storage == 4 * PAGE
        rank.quiesce()
        assert answer(rank, b).tokens == cold(b)
        rank.quiesce()
        assert from_l3(rank, b).cached.storage == 4 * PAGE  # reported to the new incarnation

        actor.down = True  # now it does not answer at all: misses, counted, right answers
        misses = rank.engine.cache.storage.counters.directory_miss_lookups
        out = from_l3(rank, a)
        assert out.tokens == cold(a) and out.cached.storage == 0
        assert answer(rank, c).tokens == cold(c)
        rank.quiesce()  # C's backups land; their report waits for the directory
        counters = rank.engine.cache.storage.counters
        assert counters.directory_miss_lookups > misses and counters.directory_errors > 0
        snap = unpack_record(RankSnapshot, rank.cache_snapshot())
        assert snap.storage["directory_miss_lookups"] > misses

        actor.restart()  # and comes back without the namespace again
        actor.down = False
        rank.quiesce()  # the rank registers it again; C's files are in the same root
        assert from_l3(rank, c).cached.storage == 4 * PAGE
        assert not any(unpack_record(CacheAudit, rank.audit()))
    finally:
        rank.close()


def test_pages_stored_while_away_are_not_published_in_storage_that_lacks_them(actor,
                                                                               tmp_path):
    a = tokens(4)
    info = register(actor, tmp_path / "first")
    rank = rank_on(actor, info)
    try:
        actor.down = True
        assert answer(rank, a).tokens == cold(a)
        rank.quiesce()  # A is written to the first root, unreported
        assert rank.engine.cache.storage.directory_away
        # The actor comes back with the namespace in another root (registered by someone
        # else): A's pages are not there, so they must never be published there.
        actor.restart()
        actor.down = False
        moved = register(actor, tmp_path / "second")
        assert moved.namespace == info.namespace and moved.options != info.options
        rank.quiesce()  # the rank sees the move and re-attaches to the second root
        assert str(rank.engine.cache.storage.backend.root.path) == str(tmp_path / "second")
        assert actor.stats(info.namespace).published_pages == 0  # nothing published
        rank.drop_cache()
        out = answer(rank, a)
        assert out.tokens == cold(a) and out.cached.storage == 0  # no hit on a page not there
        rank.quiesce()  # now written to the second root as well, and published there
        assert actor.stats(info.namespace).published_pages >= 4
    finally:
        rank.close()


def test_storage_that_cannot_be_opened_yet_is_attached_once_it_can(actor, tmp_path):
    """A replacement rank whose namespace's storage cannot be opened (a Mooncake master
    restarting) starts without it, answers with L3 misses, and attaches it at a later check
    (as the actor knows the namespace then): it never fails its instance for it."""
    from kvtier.backends.base import StorageUnavailable

    a = tokens(5)
    info = register(actor, tmp_path / "l3")
    writer = rank_on(actor, info)
    try:
        assert answer(writer, a).tokens == cold(a)
        writer.quiesce()  # A's pages are in L3
    finally:
        writer.close()
    down = [True]  # the storage refuses to open while down
    tries = []

    def open_backend(self, info, heads):
        tries.append(info.epoch)
        if down[0]:
            raise StorageUnavailable("injected: the master is restarting")
        return Rank._open_backend(self, info, heads)

    cls = type("LateRank", (Rank,), {"_directory": lambda self, name: actor,
                                          "_open_backend": open_backend})
    rank = cls(0, 1, "", SETTINGS._replace(l3=info, l3_actor="in-process"))
    try:
        assert rank.engine.cache.storage is None  # started without its L3
        out = answer(rank, a)
        assert out.tokens == cold(a) and out.cached.storage == 0  # a miss, not a failure
        assert len(tries) >= 2  # its steps tried again
        rank.detach_l3()
        assert rank.attach_l3(info.to_msgpack(), "in-process") == "file"  # refused: later
        assert rank.engine.cache.storage is None
        down[0] = False
        rank.step()  # its next step's check opens it
        assert rank.engine.cache.storage is not None
        rank.quiesce()  # the backups the attach started (its L2 holds A) settle
        assert from_l3(rank, a).cached.storage == 4 * PAGE  # the pages stored before
    finally:
        rank.close()
