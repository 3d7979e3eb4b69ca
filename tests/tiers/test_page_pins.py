"""Pinned pages in the L3 page directory (no Ray, a fake clock): quota pressure evicts other
pages, never pinned ones, and counts them; pins expire after their TTL, a hit refreshes it,
unpin hands the pages back to the quota, and a pin past its share is refused with the room it
needs."""
from __future__ import annotations

import pytest

from test_page_directory import Clock, RecordingStore, chain
from kvtier.errors import CacheUsageError, PinRoomError
from kvtier.kv_spec import HeadRange
from kvtier.messages import NamespaceSpec
from kvtier.policies import StorageBackendKind
from kvtier.tiers.page_directory import PageDirectory
from kvtier.tiers.page_eviction import run_pass
from kvtier.tiers.page_pins import MAX_PIN_TTL_S, L3PinListing


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def directory(clock):
    with PageDirectory(lambda info: RecordingStore(info), clock) as d:
        yield d


def namespace(d, max_pages=10) -> str:
    spec = NamespaceSpec("org/model", "", "fp", StorageBackendKind.SIMULATED, {}, 1, max_pages)
    return d.register(spec).namespace


def fill(d, ns, tag, n):
    pages = chain(tag, n)
    d.report_stored(ns, pages, HeadRange.of_rank(1))
    return pages


def test_quota_pressure_evicts_others_never_pinned_pages(directory, clock):
    ns = namespace(directory)
    pinned = fill(directory, ns, "a", 4)  # the oldest pages: first in line without the pin
    assert directory.pin(ns, "p", pinned, 60.0, max_fraction=0.5) == 4
    for i, tag in enumerate("bcdef"):  # 20 more pages through a 10-page quota
        clock.now += 1
        fill(directory, ns, tag, 4)
        run_pass(directory)
    assert directory.lookup(ns, pinned).hit_pages == 4
    s = directory.stats(ns)
    assert s.published_pages == 10 and s.evicted_pages == 14
    assert (s.pins, s.pinned_pages) == (1, 4)
    assert directory.pins(ns) == [L3PinListing("p", "", 4, 60.0)]


def test_a_pin_expires_after_its_ttl_then_the_quota_takes_it(directory, clock):
    ns = namespace(directory)
    pinned = fill(directory, ns, "a", 4)
    directory.pin(ns, "p", pinned, 10.0, 0.5)
    clock.now += 9.0
    fill(directory, ns, "b", 8)
    run_pass(directory)
    assert directory.lookup(ns, pinned).hit_pages == 4  # the lookup is a hit: refreshed
    clock.now += 9.0
    assert directory.stats(ns).pins == 1  # 18 s after the pin, 9 s after the hit
    clock.now += 1.5
    run_pass(directory)
    s = directory.stats(ns)
    assert (s.pins, s.pinned_pages, s.expired_pins) == (0, 0, 1)
    clock.now += 1
    fill(directory, ns, "c", 10)
    run_pass(directory)
    assert directory.lookup(ns, pinned).hit_pages == 0  # evicted like any older page now


def test_refresh_from_an_instance_hit_and_unpin(directory, clock):
    ns = namespace(directory)
    pinned = fill(directory, ns, "a", 4)
    directory.pin(ns, "p", pinned, 10.0, 0.5)
    clock.now += 8.0
    assert directory.refresh_pins(ns, ["p", "gone"]) == 1
    clock.now += 8.0
    assert directory.stats(ns).pins == 1
    assert directory.unpin(ns, "p") and not directory.unpin(ns, "p")
    fill(directory, ns, "b", 10)
    run_pass(directory)
    assert directory.lookup(ns, pinned).hit_pages == 0  # oldest, unpinned: evicted first


def test_a_pin_past_its_share_of_the_quota_is_refused_with_the_room_it_needs(directory):
    ns = namespace(directory)
    a, b = fill(directory, ns, "a", 4), fill(directory, ns, "b", 3)
    directory.pin(ns, "a", a, 60.0, 0.5)  # 5 pages for pins: 1 left
    with pytest.raises(PinRoomError, match=r"needs 3 pages, 1 free for pins in the L3 "
                                           r"namespace") as err:
        directory.pin(ns, "b", b, 60.0, 0.5)
    assert (err.value.needed_pages, err.value.free_pages) == (3, 1)
    assert directory.stats(ns).pins == 1
    assert directory.pin(ns, "a2", a[:2], 60.0, 0.5) == 2  # shares its pages: fits
    assert directory.pin(ns, "c", chain("c", 3), 60.0, 0.5) == 0  # nothing published: no pin
    assert [p.pin_id for p in directory.pins(ns)] == ["a", "a2"]


def test_an_unbounded_namespace_has_no_pin_share_and_ttls_are_bounded(directory):
    ns = namespace(directory, max_pages=0)
    pages = fill(directory, ns, "a", 50)
    assert directory.pin(ns, "p", pages, MAX_PIN_TTL_S, 0.1) == 50
    for bad in (0, -1.0, MAX_PIN_TTL_S + 1, True, "10"):
        with pytest.raises(CacheUsageError, match="ttl_s"):
            directory.pin(ns, "q", pages, bad, 0.1)
