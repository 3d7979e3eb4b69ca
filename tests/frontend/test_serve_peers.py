"""`kvtier serve --l3 none --peer-transport nixl`: L3 off, each instance reads what the other
holds in L2 (docs/architecture.md, "Peer-to-peer L2"). Both instances are listed as peers in
the namespace's directory; a question the router sends away from a busy holder is answered
from the holder's L2, counted as `peer`, with the holder's answer; attaching L3 and detaching
it again keeps them peers."""
from __future__ import annotations

import random
import threading

import pytest
import requests
from eventually import eventually
from http_client import ServeClient
from shared_serve import BASE, served

from kvtier.frontend.settings import ServeSettings

KEY = "test-admin-key-peers-0123456789"
PAGE = 16
SETTINGS = ServeSettings(model="tiny", instances=2, page_size=PAGE, chunk_tokens=64,
                         device_pages=96, max_new_tokens=256, dtype="fp32", admin_key=KEY,
                         storage_backend="none", peer_transport="nixl",
                         hicache={"prefetch_threshold_tokens": PAGE,
                                  "prefetch_policy": "wait_complete"})
CLIENT = ServeClient(BASE, SETTINGS.served_model_name, KEY)
ADMIN = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def app():
    with served(SETTINGS):
        yield


def _directory():
    """The namespace actor's client and the one namespace the instances share."""
    import ray

    from kvtier.actors.l3.namespace_actor import RAY_NAMESPACE, NamespaceClient

    client = NamespaceClient(ray.get_actor(SETTINGS.l3_actor, namespace=RAY_NAMESPACE))
    (ns,) = client.namespaces()
    return client, ns


def test_a_question_sent_away_from_a_busy_holder_is_read_from_its_l2(app):
    client, ns = _directory()
    eventually(lambda: client.stats(ns).peer_holders == 2, 30, "both instances are peers",
               interval_s=0.2)
    assert [i["l3"] for i in requests.get(f"{BASE}/admin/storage", headers=ADMIN,
                                          timeout=30).json()["instances"]] == [None, None]
    doc = [random.Random(5).randrange(100, 40000) for _ in range(3 * PAGE + 3)]
    first = CLIENT.complete(doc, max_tokens=8)
    holder = first["kvtier"]["instance"]
    hashes = client.info(ns).spec.key_namespace.page_hashes(doc, PAGE)
    eventually(lambda: {h.holder: h.pages for h in client.l2_holders(ns, hashes)}.get(holder)
               == 3, 30, "the directory lists the holder's pages", interval_s=0.1)
    # the busy question below goes to the holder only once the router has its pages indexed
    # and has seen the first answer end (loads and cache events reach it a poll later; a
    # holder still counted busy would tie with a peer read elsewhere)
    eventually(lambda: (CLIENT.router()[holder]["indexed_pages"] >= 3
                        and CLIENT.router()[holder]["load"] == 0), 30,
               "the router indexed the holder's pages and saw it idle", interval_s=0.1)
    answered: list[dict] = []
    busy = threading.Thread(target=lambda: answered.append(
        CLIENT.complete(doc + [7], max_tokens=256, ignore_eos=True)))
    busy.start()
    try:
        eventually(lambda: CLIENT.router()[holder]["load"] >= 1, 60, "the holder busy",
                   interval_s=0.05)
        other = CLIENT.complete(doc, max_tokens=8)
    finally:
        busy.join()
    assert answered[0]["kvtier"]["instance"] == holder, answered[0]["kvtier"]["route"]
    assert other["kvtier"]["instance"] != holder, other["kvtier"]["route"]
    assert other["kvtier"]["route"]["expected_pages"]["peer_pages"] == 3
    assert other["kvtier"]["cached_tokens"] == {"device": 0, "host": 0, "storage": 0,
                                                "peer": 3 * PAGE}
    assert other["choices"][0]["text"] == first["choices"][0]["text"]


def test_attaching_l3_and_detaching_it_again_keeps_the_instances_peers(app):
    client, ns = _directory()
    on = requests.post(f"{BASE}/admin/storage/attach", headers=ADMIN, timeout=60,
                       json={"backend": "file"})
    assert on.status_code == 200, on.text
    assert {i["l3"]["backend"] for i in on.json()["instances"]} == {"file"}
    eventually(lambda: client.stats(on.json()["instances"][0]["l3"]["namespace"]
                                     ).peer_holders == 2, 30, "peers with L3 attached",
               interval_s=0.2)
    off = requests.post(f"{BASE}/admin/storage/detach", headers=ADMIN, timeout=60)
    assert off.status_code == 200, off.text
    assert [i["l3"] for i in off.json()["instances"]] == [None, None]
    eventually(lambda: client.stats(ns).peer_holders == 2, 30, "peers again, L3 off",
               interval_s=0.2)
    CLIENT.chat([{"role": "user", "content": "served without L3, with peers"}], max_tokens=4)
