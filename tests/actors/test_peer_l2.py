"""Peer-to-peer L2 on Ray: instances of one namespace with L3 off (its directory alone) read
the pages of a prompt another instance holds in its L2, over NIXL, into their own L2. At TP 1
and 3 and across TP sizes the answers equal the cold answers and count as `peer` hits; a
holder whose pages are gone by the time it is read, and a holder killed between the look-up
and the read, are misses: the reader computes the prompt and answers the same; a holder busy
in a long step is read all the same."""
from __future__ import annotations

import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import ray
import ray.cloudpickle
import torch
from eventually import eventually
from test_cross_tp_l3_actors import cold  # noqa: F401 - the fixture: an in-process rank
from test_tp3_shared_l3 import CONFIG, GREEDY, PAGE, PER_RANK_CPUS, SETTINGS, SOURCE, _tokens

from kvtier.actors.instance import Instance
from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
from kvtier.actors.rank_actor import Rank
from kvtier.cli.demo import namespace_spec

pytestmark = pytest.mark.timeout(600)
DOC_PAGES = 5
INCARNATIONS: dict[str, str] = {}  # holder -> the incarnation its peer_open started


class SlowReadRank(Rank):
    """A rank that waits `PAUSE_S` between looking a holder's pages up and reading them (the
    test kills the holder meanwhile)."""

    PAUSE_S = 3.0

    def peer_open(self, *args, **kwargs) -> None:
        super().peer_open(*args, **kwargs)
        reader = self.peer_link.reader
        looked_up = reader.lookup_fn

        def slowly(rank, keys, heads):
            lend = looked_up(rank, keys, heads)
            time.sleep(self.PAUSE_S)
            return lend
        reader.lookup_fn = slowly


class BusyRank(Rank):
    """A rank whose actor thread can be kept busy (`busy`), as a long step keeps it, until a
    file appears."""

    BUSY_S = 120.0  # busy at most this long, whatever the test does

    def busy(self, started: str, release: str) -> bool:
        """Write `started`, then hold the actor thread until `release` exists: whether it
        did (not timed out)."""
        Path(started).touch()
        deadline = time.monotonic() + self.BUSY_S
        while time.monotonic() < deadline:
            if Path(release).exists():
                return True
            time.sleep(0.05)
        return False


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster(shared_ray, tmp_path_factory):
    """Instances a1 (its rank can be kept busy), b1, doomed (TP 1), a3, b3 (TP 3) and slow
    (TP 1, pausing between a look-up and the read) on one namespace,
    its directory only: nothing is written to or read from L3."""
    tmp = tmp_path_factory.mktemp("peer")
    name = f"kvtier-test-{uuid.uuid4().hex[:8]}"
    client = get_or_create_namespace_actor(name, str(tmp / "state"))
    made: dict[str, Instance] = {}
    try:
        spec = namespace_spec(SOURCE, CONFIG, "file", str(tmp / "l3"), "tiny",
                              f"t-{uuid.uuid4().hex[:6]}", dtype=torch.float32, page_size=PAGE)
        info = client.register(spec)
        for holder, tp in (("a1", 1), ("b1", 1), ("a3", 3), ("b3", 3), ("doomed", 1),
                           ("slow", 1)):
            inst = made[holder] = Instance(
                SETTINGS._replace(l3=info, l3_actor=name, l3_storage=False), tp_size=tp,
                num_cpus_per_rank=PER_RANK_CPUS, ready_timeout_s=120.0, step_timeout_s=60.0,
                rank_class={"slow": SlowReadRank, "a1": BusyRank}.get(holder, Rank))
            INCARNATIONS[holder] = inst.peer_open(holder, "nixl")
        yield made, client, info
    finally:
        for inst in made.values():
            inst.close()
        client.shutdown()


def _cold(cold, prompts):
    out = []
    for prompt in prompts:
        cold.drop_cache()
        out.append(cold.engine.generate([prompt], GREEDY)[0].tokens)
    return out


def _held(cluster, holder: str, prompt) -> list[str]:
    """`holder` answers `prompt`, until the directory lists it holding the prompt's whole
    pages in L2; the pages' keys."""
    made, client, info = cluster
    made[holder].generate([prompt], GREEDY)
    made[holder].quiesce()
    hashes = info.spec.key_namespace.page_hashes(prompt, PAGE)
    eventually(lambda: any(h.holder == holder and h.pages >= DOC_PAGES
                           for h in client.l2_holders(info.namespace, hashes)),
               30, f"the directory lists {holder}'s pages", interval_s=0.1)
    return hashes


def test_a_rank_reads_with_as_many_endpoints_as_the_hosts_cores_go_round():
    from kvtier.actors.l3.peer_link import READ_LANES, read_lanes
    assert READ_LANES == 2
    assert [read_lanes(tp, cores=2) for tp in (1, 2, 3)] == [2, 1, 1]
    assert (read_lanes(8, cores=64), read_lanes(1, cores=1)) == (2, 1)


@pytest.mark.parametrize("writer, reader", [("a1", "b1"), ("a3", "b3"), ("a1", "b3"),
                                            ("a3", "b1")])
def test_a_reader_hits_what_a_peer_holds_in_l2(cluster, cold, writer, reader):
    made, client, info = cluster
    prompt = _tokens(hash((writer, reader)) % 1000, DOC_PAGES * PAGE + 3)
    (expected,) = _cold(cold, [prompt])
    made[reader].drop_cache()
    _held(cluster, writer, prompt)
    got = made[reader].generate([prompt], GREEDY)[0]
    assert got.tokens == expected
    assert got.cached.peer >= (DOC_PAGES - 1) * PAGE and got.cached.storage == 0, got.cached
    assert client.stats(info.namespace).published_pages == 0  # L3 was never written


def test_pages_gone_from_the_holder_are_a_miss(cluster, cold):
    """The directory still lists the pages (a report the holder has not sent yet), the
    holder no longer has them: its table lists none, and the reader computes the prompt."""
    made, client, info = cluster
    prompt = _tokens(4242, DOC_PAGES * PAGE + 3)
    (expected,) = _cold(cold, [prompt])
    hashes = _held(cluster, "a1", prompt)
    made["a1"].drop_cache()
    client.report_l2(info.namespace, "a1", INCARNATIONS["a1"], hashes)  # stale on purpose
    made["b1"].drop_cache()
    got = made["b1"].generate([prompt], GREEDY)[0]
    assert got.tokens == expected
    assert got.cached.peer == 0, got.cached


def test_a_holder_killed_mid_read_is_a_miss(cluster, cold):
    """The reader has looked the pages up in the holder's table; the holder's rank is killed
    before the pages are read: a miss, and the reader computes the prompt."""
    made, client, info = cluster
    alive, prompt = _tokens(776, DOC_PAGES * PAGE + 3), _tokens(777, DOC_PAGES * PAGE + 3)
    expected_alive, expected = _cold(cold, [alive, prompt])
    _held(cluster, "doomed", alive)
    made["slow"].drop_cache()
    first = made["slow"].generate([alive], GREEDY)[0]  # the pause alone is no miss
    assert first.tokens == expected_alive and first.cached.peer > 0, first.cached
    _held(cluster, "doomed", prompt)
    made["slow"].drop_cache()
    got: list = []
    reading = threading.Thread(target=lambda: got.append(
        made["slow"].generate([prompt], GREEDY)[0]))
    reading.start()
    time.sleep(1.5)  # slow has looked the pages up and waits PAUSE_S before reading them
    made["doomed"].kill_rank(0)
    reading.join(120)
    assert got and got[0].tokens == expected
    assert got[0].cached.peer == 0, got[0].cached


def test_a_busy_holder_is_read_without_waiting_for_its_step(cluster, cold, tmp_path):
    """The holder's actor thread is busy (as in a long prefill): nothing of the read needs
    it, and the reader hits."""
    made, client, info = cluster
    prompt = _tokens(31337, DOC_PAGES * PAGE + 3)
    (expected,) = _cold(cold, [prompt])
    _held(cluster, "a1", prompt)
    made["b1"].drop_cache()
    started, release = tmp_path / "started", tmp_path / "release"
    busy = made["a1"].rank_group.actors[0].busy.remote(str(started), str(release))
    try:
        eventually(started.exists, 30, "a1's rank is busy", interval_s=0.1)
        got = made["b1"].generate([prompt], GREEDY)[0]
    finally:
        release.touch()
    assert ray.get(busy, timeout=60)  # busy until released: all through the read
    assert got.tokens == expected
    assert got.cached.peer >= (DOC_PAGES - 1) * PAGE, got.cached
