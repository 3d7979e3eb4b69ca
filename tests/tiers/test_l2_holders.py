"""The namespace directory's list of who holds which pages in L2 (tiers/l2_holders), through
PageDirectory, the namespace service's records (FakeNamespaceClient: the actor's bytes without
Ray) and the reporter an instance feeds (actors/l3/l2_reporter)."""
from __future__ import annotations

import pytest

from kvtier.actors.l3.l2_reporter import L2Reporter
from kvtier.actors.l3.namespace_actor import FakeNamespaceClient
from kvtier.messages import (L2Forget, L2Holding, L2Listing, L2Receipt, L2Report, L2Standing,
                             MessageError, NamespaceSpec, PeerContact, PeerOffer, PeerRank,
                             PeerRegistration)
from kvtier.policies import StorageBackendKind
from kvtier.tiers.l2_holders import L2Holders


def h(i: int, tag: str = "a") -> str:
    return f"{tag}{i:063x}"


def chain(n: int, tag: str = "a") -> list[str]:
    return [h(i, tag) for i in range(n)]


I1 = "i1"  # the one incarnation of each holder here (test_l2_leases.py tries several)


def test_each_holder_is_listed_with_its_leading_run_longest_first():
    l2 = L2Holders()
    l2.apply("x", I1, chain(5))
    l2.apply("y", I1, chain(3))
    l2.apply("z", I1, chain(5)[1:])  # not the first page: no run
    assert l2.leading(chain(6)) == (L2Holding("x", 5), L2Holding("y", 3))
    l2.apply("x", I1, (), dropped=[h(2)])  # a hole ends x's run there
    assert l2.leading(chain(6)) == (L2Holding("y", 3), L2Holding("x", 2))
    assert l2.leading([]) == () and l2.leading([h(9, "b")]) == ()
    assert len(l2) == 5 and l2.holders == 3


def test_replace_and_forget_leave_nothing_of_the_holder_behind():
    l2 = L2Holders()
    l2.apply("x", I1, chain(4))
    l2.apply("y", I1, chain(2))
    l2.apply("x", I1, [h(7, "b")], replace=True)
    assert l2.leading(chain(4)) == (L2Holding("y", 2),)
    assert l2.held_by("x") == 1
    assert l2.forget("x", I1) == 1 and l2.forget("x", I1) == 0
    assert len(l2) == 2 and l2.holders == 1
    l2.apply("y", I1, (), dropped=chain(2))
    assert len(l2) == 0 and l2.holders == 0


def test_a_holder_lists_at_most_its_bound_the_oldest_go_first():
    l2 = L2Holders(max_pages_per_holder=3)
    l2.apply("x", I1, chain(5))
    assert l2.held_by("x") == 3 and l2.dropped_entries == 2
    assert l2.leading(chain(5)) == ()  # pages 0 and 1 went first
    assert l2.leading(chain(5)[2:]) == (L2Holding("x", 3),)


def test_the_records_are_checked():
    report = L2Report("ns", "instance-0", "i7", tuple(chain(2)), (h(5),), True)
    assert L2Report.from_msgpack(report.to_msgpack()) == report
    listing = L2Listing("ns", (L2Holding("a", 2),))
    assert L2Listing.from_msgpack(listing.to_msgpack()) == listing
    receipt = L2Receipt(3, L2Standing.UNLISTED)
    assert L2Receipt.from_msgpack(receipt.to_msgpack()) == receipt
    forget = L2Forget("instance-0", "i7")
    assert L2Forget.from_msgpack(forget.to_msgpack()) == forget
    registration = PeerRegistration("ns", "instance-0", "i7", _rank(0, 1))
    assert PeerRegistration.from_msgpack(registration.to_msgpack()) == registration
    with pytest.raises(MessageError, match="holder"):
        L2Report("ns", "", I1, ())
    with pytest.raises(MessageError, match="hex"):
        L2Report("ns", "x", I1, ("nothex",))
    for bad in ("", "i" * 129, 7):
        with pytest.raises(MessageError, match="incarnation"):
            L2Report("ns", "x", bad, ())  # type: ignore[arg-type]
        with pytest.raises(MessageError, match="incarnation"):
            L2Forget("x", bad)  # type: ignore[arg-type]
        with pytest.raises(MessageError, match="incarnation"):
            PeerRegistration("ns", "x", bad, _rank(0, 1))  # type: ignore[arg-type]
    with pytest.raises(MessageError):  # a report without one is refused on decode too
        L2Report.from_map({"type": "L2Report", "namespace": "ns", "holder": "x", "held": []})


@pytest.fixture
def client():
    with FakeNamespaceClient() as c:
        yield c


@pytest.fixture
def ns(client):
    spec = NamespaceSpec("org/model", "", "fp", StorageBackendKind.SIMULATED, {}, 2, 0)
    return client.register(spec).namespace


def test_the_directory_lists_l2_holders_per_namespace_and_counts_them(client, ns):
    assert client.report_l2(ns, "a", I1, chain(3)) == L2Receipt(3, L2Standing.UNLISTED)
    assert client.report_l2(ns, "b", I1, chain(2)).pages == 2
    assert client.report_l2(ns, "b", I1, ()) == L2Receipt(2, L2Standing.LISTED)  # a renewal
    assert client.l2_holders(ns, chain(3)) == (L2Holding("a", 3), L2Holding("b", 2))
    stats = client.stats(ns)
    assert (stats.l2_pages, stats.l2_holders) == (3, 2)
    assert stats.published_pages == 0  # L2 holdings publish nothing in L3
    assert client.forget_l2("a", I1) == 3
    assert client.l2_holders(ns, chain(3)) == (L2Holding("b", 2),)


def test_a_reporter_sends_net_changes_and_makes_a_failed_report_good(client, ns):
    class Flaky:
        fail = False

        def report_l2(self, *args, **kw):
            if self.fail:
                raise OSError("directory down")
            return client.report_l2(*args, **kw)

        def forget_l2(self, holder, incarnation):
            return client.forget_l2(holder, incarnation)

    flaky = Flaky()
    reporter = L2Reporter(flaky, ns, "instance-0", "now", interval_s=3600)  # flushed by hand
    try:
        client.report_l2(ns, "instance-0", "earlier", [h(9, "c")])  # an earlier run's leftover
        reporter.held(chain(4))
        reporter.dropped([h(3)])
        assert reporter.flush()
        assert client.l2_holders(ns, chain(4)) == (L2Holding("instance-0", 3),)
        assert client.l2_holders(ns, [h(9, "c")]) == ()  # the first report replaced it

        flaky.fail = True
        reporter.dropped([h(2)])
        assert not reporter.flush() and reporter.failures == 1
        flaky.fail = False
        reporter.held([h(0, "d")])
        assert reporter.flush()  # everything again: the lost drop is made good
        assert client.l2_holders(ns, chain(4)) == (L2Holding("instance-0", 2),)
        assert client.l2_holders(ns, [h(0, "d")]) == (L2Holding("instance-0", 1),)

        reporter.cleared()  # new ranks: an empty L2
        assert reporter.flush()
        assert client.stats(ns).l2_pages == 0
        reporter.held(chain(2))
        assert reporter.flush()
    finally:
        reporter.close()
    assert client.stats(ns).l2_holders == 0  # closed: forgotten


def _rank(r: int, size: int, actor: str = "") -> PeerRank:
    per = 6 // size
    return PeerRank(r, size, r * per, (r + 1) * per, actor or f"rank-{r}", "ray-ns")


def test_a_peer_is_offered_once_every_rank_registered_and_never_to_itself(client, ns):
    client.report_l2(ns, "a", I1, chain(4))
    client.report_l2(ns, "b", I1, chain(2))
    assert client.best_peer(ns, chain(4), "c") == PeerOffer(ns, 0, None)  # nobody lends
    client.register_peer(ns, "a", I1, _rank(0, 2))
    assert client.best_peer(ns, chain(4), "c").pages == 0  # a's rank 1 is not there yet
    client.register_peer(ns, "b", I1, _rank(0, 1))
    offer = client.best_peer(ns, chain(4), "c")  # a holds more but is not reachable yet
    assert (offer.pages, offer.contact.holder) == (2, "b")
    client.register_peer(ns, "a", I1, _rank(1, 2))
    assert client.stats(ns).peer_holders == 2
    client.report_l2(ns, "a", I1, chain(4), replace=True)  # a report keeps the contact
    offer = client.best_peer(ns, chain(4), "c")
    assert offer.pages == 4 and offer.contact == PeerContact(ns, "a", (_rank(0, 2), _rank(1, 2)))
    assert client.best_peer(ns, chain(4), "a").contact.holder == "b"  # not itself
    # a restarted at TP 1: its rank of the new size replaces both old ones
    client.register_peer(ns, "a", I1, _rank(0, 1, "new"))
    assert client.best_peer(ns, chain(4), "c").contact.ranks == (_rank(0, 1, "new"),)
    client.forget_l2("a", I1)  # stopped: neither its pages nor its contact are offered
    assert client.best_peer(ns, chain(4), "c").contact.holder == "b"
    assert PeerOffer.from_msgpack(offer.to_msgpack()) == offer
