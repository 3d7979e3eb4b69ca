"""The L2 listing as a lease, and holders told apart by incarnation (tiers/l2_holders.py):
a holder not heard from for HOLDER_TTL_S is dropped, pages and contacts, and never offered
as a peer again; a renewing holder never is; a new incarnation of a name replaces the old
one, and nothing the old one sends afterwards changes anything. Through L2Holders, the
namespace service's records (FakeNamespaceClient over a PageDirectory with a fake clock),
the L2 reporter and the ranks' contact keepers."""
from __future__ import annotations

import time

import pytest
from eventually import eventually

from kvtier.actors.l3.contact_keeper import ContactKeeper
from kvtier.actors.l3.l2_reporter import L2Reporter
from kvtier.actors.l3.namespace_actor import FakeNamespaceClient
from kvtier.messages import L2Holding, L2Receipt, L2Standing, NamespaceSpec, PeerRank
from kvtier.policies import StorageBackendKind
from kvtier.tiers.l2_holders import HOLDER_TTL_S, RENEW_INTERVAL_S, L2Holders, new_incarnation
from kvtier.tiers.page_directory import PageDirectory


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def h(i: int, tag: str = "a") -> str:
    return f"{tag}{i:063x}"


def chain(n: int, tag: str = "a") -> list[str]:
    return [h(i, tag) for i in range(n)]


def rank(r: int, size: int = 1, actor: str = "") -> PeerRank:
    return PeerRank(r, size, r, r + 1, actor or f"rank-{r}", "ray-ns")


def test_the_bound_is_seconds_and_renewals_come_well_inside_it():
    assert 2 <= HOLDER_TTL_S <= 60 and RENEW_INTERVAL_S * 4 <= HOLDER_TTL_S
    assert new_incarnation() != new_incarnation()


# ---- L2Holders ---------------------------------------------------------------------------------
@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def l2(clock):
    return L2Holders(clock=clock)


def test_a_silent_holder_is_dropped_pages_and_contacts_after_the_ttl_not_before(clock, l2):
    l2.apply("x", "x1", chain(4))
    l2.register_peer("x", "x1", rank(0))
    l2.apply("y", "y1", chain(2))
    l2.register_peer("y", "y1", rank(0))
    clock.advance(HOLDER_TTL_S - 0.5)
    l2.apply("y", "y1", ())  # y renews, x says nothing
    offer = l2.best_peer("ns", chain(4), "z")
    assert (offer.pages, offer.contact.holder) == (4, "x")  # not yet
    clock.advance(1.0)
    offer = l2.best_peer("ns", chain(4), "z")
    assert (offer.pages, offer.contact.holder) == (2, "y")  # x is gone
    assert l2.contact("ns", "x") is None and l2.held_by("x") == 0
    assert l2.leading(chain(4)) == (L2Holding("y", 2),)
    assert (len(l2), l2.holders, l2.peers, l2.expired_holders) == (2, 1, 1, 1)
    assert l2.incarnation("x") is None
    clock.advance(HOLDER_TTL_S)
    assert l2.best_peer("ns", chain(4), "z").contact is None and len(l2) == 0


def test_renewals_keep_a_holder_listed_and_reachable(clock, l2):
    l2.apply("x", "x1", chain(3))
    l2.register_peer("x", "x1", rank(0))
    for step in range(int(5 * HOLDER_TTL_S / RENEW_INTERVAL_S)):
        clock.advance(RENEW_INTERVAL_S)
        if step % 2:  # either kind of call renews: the reporter's or a rank's
            assert l2.apply("x", "x1", ()) is L2Standing.LISTED
        else:
            assert l2.register_peer("x", "x1", rank(0))
    assert l2.best_peer("ns", chain(3), "z").pages == 3 and l2.expired_holders == 0


def test_a_holder_back_after_its_lease_ran_out_is_told_to_list_everything(clock, l2):
    assert l2.apply("x", "x1", chain(3), replace=True) is L2Standing.UNLISTED  # its first
    assert l2.apply("x", "x1", [h(3)]) is L2Standing.LISTED
    clock.advance(HOLDER_TTL_S + 1)  # cut off meanwhile
    assert l2.apply("x", "x1", ()) is L2Standing.UNLISTED  # a renewal: the listing is gone
    assert l2.held_by("x") == 0
    assert l2.apply("x", "x1", chain(4), replace=True) is L2Standing.LISTED
    assert l2.register_peer("x", "x1", rank(0))  # its rank's next renewal: reachable again
    assert l2.best_peer("ns", chain(4), "z").pages == 4


def test_a_newer_incarnation_replaces_the_older_which_then_changes_nothing(clock, l2):
    l2.apply("x", "old", chain(4))
    l2.register_peer("x", "old", rank(0, 2))
    l2.register_peer("x", "old", rank(1, 2))
    assert l2.best_peer("ns", chain(4), "z").pages == 4
    # a new replica of the same name (a rolling redeploy) registers a rank, then reports
    assert l2.register_peer("x", "new", rank(0, 1, "new-0"))
    assert l2.held_by("x") == 0 and l2.contact("ns", "x").ranks == (rank(0, 1, "new-0"),)
    assert l2.apply("x", "new", chain(2)) is L2Standing.UNLISTED
    assert l2.incarnation("x") == "new"
    # the old replica is still running, then stops: nothing it sends counts
    assert l2.apply("x", "old", chain(4), replace=True) is L2Standing.RETIRED
    assert l2.apply("x", "old", ()) is L2Standing.RETIRED
    assert not l2.register_peer("x", "old", rank(1, 2))
    assert l2.forget("x", "old") == 0
    offer = l2.best_peer("ns", chain(4), "z")
    assert offer.pages == 2 and offer.contact.ranks == (rank(0, 1, "new-0"),)
    # the old one's calls renew nothing either: the new one's lease runs from its own calls
    clock.advance(HOLDER_TTL_S - 1)
    l2.apply("x", "old", ())
    clock.advance(2)
    assert l2.best_peer("ns", chain(4), "z").contact is None
    assert l2.forget("x", "new") == 0  # already expired


def test_forget_retires_an_incarnation_and_leaves_others_alone(clock, l2):
    l2.apply("x", "x1", chain(2))
    l2.register_peer("x", "x1", rank(0))
    assert l2.forget("x", "x2") == 0 and l2.held_by("x") == 2  # not the current one
    assert l2.forget("x", "x1") == 2
    assert l2.contact("ns", "x") is None and l2.peers == 0
    # a rank's renewal that was on its way, and a late report: ignored, nothing comes back
    assert not l2.register_peer("x", "x1", rank(0))
    assert l2.apply("x", "x1", chain(2)) is L2Standing.RETIRED
    assert l2.held_by("x") == 0 and l2.incarnation("x") is None
    assert l2.apply("x", "x3", chain(1)) is L2Standing.UNLISTED  # a new start is listed


# ---- the namespace service, the reporter and the contact keepers --------------------------------
@pytest.fixture
def client(clock):
    with FakeNamespaceClient(directory=PageDirectory(clock=clock)) as c:
        yield c


@pytest.fixture
def ns(client):
    spec = NamespaceSpec("org/model", "", "fp", StorageBackendKind.SIMULATED, {}, 2, 0)
    return client.register(spec).namespace


class Flaky:
    """The client, or a directory that does not answer (`down`)."""

    def __init__(self, client: FakeNamespaceClient) -> None:
        self.client, self.down = client, False

    def report_l2(self, *args, **kw):
        self._check()
        return self.client.report_l2(*args, **kw)

    def forget_l2(self, *args):
        self._check()
        return self.client.forget_l2(*args)

    def register_peer(self, *args):
        self._check()
        return self.client.register_peer(*args)

    def _check(self) -> None:
        if self.down:
            raise OSError("cut off from the directory")


class Holder:
    """A holder as an engine runs one: its reporter (in one process) and its ranks' contact
    keepers (in others), under one incarnation, driven by hand on a fake clock."""

    def __init__(self, directory, ns: str, name: str, clock: Clock, size: int = 1) -> None:
        self.incarnation = new_incarnation()
        self.reporter = L2Reporter(directory, ns, name, self.incarnation, interval_s=3600,
                                   clock=clock)
        self.keepers = [ContactKeeper(directory, ns, name, self.incarnation,
                                      rank(r, size, f"{name}-{r}"), interval_s=3600)
                        for r in range(size)]

    def tick(self) -> None:
        """What its threads do every RENEW_INTERVAL_S."""
        self.reporter.flush()
        for keeper in self.keepers:
            keeper.renew()

    def killed(self) -> None:
        """SIGKILL: its threads stop and nobody tells the directory."""
        self.reporter._stop.set()
        for keeper in self.keepers:
            keeper.close()

    def close(self) -> None:
        for keeper in self.keepers:
            keeper.close()
        self.reporter.close()


def test_a_killed_holder_is_dropped_by_the_directory_within_the_ttl(client, ns, clock):
    live, doomed = Holder(client, ns, "live", clock), Holder(client, ns, "doomed", clock, 2)
    try:
        live.reporter.held(chain(2))
        doomed.reporter.held(chain(5))
        for _ in range(10):  # both renew for longer than the TTL: both stay
            clock.advance(RENEW_INTERVAL_S)
            live.tick()
            doomed.tick()
        assert client.best_peer(ns, chain(5), "reader").contact.holder == "doomed"
        doomed.killed()
        clock.advance(HOLDER_TTL_S - 0.5)
        live.tick()
        assert client.best_peer(ns, chain(5), "reader").contact.holder == "doomed"
        clock.advance(0.5)  # HOLDER_TTL_S since its last call
        offer = client.best_peer(ns, chain(5), "reader")
        assert (offer.pages, offer.contact.holder) == (2, "live")
        stats = client.stats(ns)
        assert (stats.l2_holders, stats.peer_holders, stats.l2_pages) == (1, 1, 2)
        assert client.l2_holders(ns, chain(5)) == (L2Holding("live", 2),)
    finally:
        live.close()
        doomed.reporter.close()


def test_a_holder_cut_off_past_the_ttl_comes_back_whole(client, ns, clock):
    flaky = Flaky(client)
    holder = Holder(flaky, ns, "x", clock, size=2)
    try:
        holder.reporter.held(chain(3))
        holder.tick()
        assert client.best_peer(ns, chain(3), "reader").pages == 3
        flaky.down = True
        for _ in range(int(HOLDER_TTL_S / RENEW_INTERVAL_S) + 1):
            clock.advance(RENEW_INTERVAL_S)
            holder.tick()  # every call fails
        holder.reporter.held([h(3)])
        assert client.best_peer(ns, chain(4), "reader").contact is None  # dropped
        flaky.down = False
        holder.tick()  # the reporter lists everything, the ranks register again
        offer = client.best_peer(ns, chain(4), "reader")
        assert offer.pages == 4 and len(offer.contact.ranks) == 2
    finally:
        holder.close()


def test_a_reporter_whose_listing_expired_lists_everything_next(client, ns, clock):
    reporter = L2Reporter(client, ns, "x", "x1", interval_s=3600, clock=clock)
    try:
        reporter.held(chain(3))
        assert reporter.flush() and client.l2_holders(ns, chain(3)) == (L2Holding("x", 3),)
        clock.advance(HOLDER_TTL_S + 1)  # its renewals were lost (a stalled process)
        assert client.l2_holders(ns, chain(3)) == ()
        assert reporter.flush()  # a renewal, answered UNLISTED
        assert reporter.renewals == 1
        assert reporter.flush()  # so the next report lists everything
        assert client.l2_holders(ns, chain(3)) == (L2Holding("x", 3),)
    finally:
        reporter.close()


def test_the_old_replica_shutting_down_leaves_the_new_one_listed(client, ns, clock):
    old = Holder(client, ns, "replica-0", clock)
    old.reporter.held(chain(3))
    old.tick()
    new = Holder(client, ns, "replica-0", clock)  # a rolling redeploy: the same name
    try:
        new.reporter.held(chain(2))
        new.tick()
        old.reporter.held([h(3)])
        old.tick()  # still running: ignored
        old.close()  # its forget: ignored too
        offer = client.best_peer(ns, chain(4), "reader")
        assert offer.pages == 2 and offer.contact.ranks[0].actor == "replica-0-0"
        assert client.forget_l2("replica-0", old.incarnation) == 0
        for _ in range(10):  # and its contact, registered once long ago, does not expire
            clock.advance(RENEW_INTERVAL_S)
            new.tick()
        assert client.best_peer(ns, chain(4), "reader").pages == 2
    finally:
        new.close()
    assert client.stats(ns).l2_holders == 0


# ---- the reporter renews on its own -------------------------------------------------------------
class Recording:
    def __init__(self) -> None:
        self.reports: list[tuple] = []

    def report_l2(self, ns, holder, incarnation, held, dropped=(), replace=False):
        self.reports.append((incarnation, tuple(held), tuple(dropped), replace))
        return L2Receipt(0, L2Standing.LISTED)

    def forget_l2(self, holder, incarnation):
        return 0


def test_an_idle_reporter_renews_every_interval_and_no_more(clock):
    directory = Recording()
    reporter = L2Reporter(directory, "ns", "x", "x1", interval_s=3600, clock=clock)
    try:
        assert reporter.flush() and directory.reports == [("x1", (), (), True)]  # the first
        clock.advance(RENEW_INTERVAL_S - 0.1)
        assert reporter.flush() and len(directory.reports) == 1  # nothing due
        clock.advance(0.1)
        assert reporter.flush() and directory.reports[-1] == ("x1", (), (), False)
        assert reporter.renewals == 1
        reporter.held([h(0)])
        clock.advance(RENEW_INTERVAL_S - 0.1)
        assert reporter.flush() and directory.reports[-1] == ("x1", (h(0),), (), False)
        clock.advance(0.2)  # a report renews too: the next renewal is due from it
        assert reporter.flush() and len(directory.reports) == 3
    finally:
        reporter.close()


def test_the_reporters_thread_renews_while_nothing_changes():
    directory = Recording()
    reporter = L2Reporter(directory, "ns", "x", "x1", interval_s=0.01, renew_s=0.05)
    try:
        eventually(lambda: reporter.renewals >= 3, 5, "three renewals", interval_s=0.01)
    finally:
        reporter.close()
    assert all(r[1:] == ((), (), False) for r in directory.reports[1:])


def test_a_contact_keeper_registers_at_once_and_renews_on_its_thread(client, ns, clock):
    keeper = ContactKeeper(client, ns, "x", "x1", rank(0), interval_s=0.01)
    try:
        assert client.best_peer(ns, chain(1), "reader").contact is None  # no pages yet
        client.report_l2(ns, "x", "x1", chain(1))
        assert client.best_peer(ns, chain(1), "reader").contact.holder == "x"
        eventually(lambda: keeper.renewals >= 3, 5, "three renewals", interval_s=0.01)
    finally:
        keeper.close()
    renewed = keeper.renewals
    time.sleep(0.05)
    assert keeper.renewals == renewed  # closed: no more


def test_a_contact_keeper_that_cannot_register_at_all_raises(client, ns):
    flaky = Flaky(client)
    flaky.down = True
    with pytest.raises(OSError):
        ContactKeeper(flaky, ns, "x", "x1", rank(0))
