"""`kvtier serve --peer-transport nixl`: every rank of both instances lends its L2 to the
other instance and reads the other's (docs/architecture.md, "Peer-to-peer L2"); the
directory lists both as peers, each replica reports its own L2 (its ranks do not report it
again), and detaching L3 takes them off the list until it is attached again."""
from __future__ import annotations

import random

import pytest
import requests
from eventually import eventually
from http_client import ServeClient
from shared_serve import BASE, served

from kvtier.frontend.settings import ServeSettings

KEY = "test-admin-key-peers-0123456789"
SETTINGS = ServeSettings(model="tiny", instances=2, page_size=16, chunk_tokens=64,
                         device_pages=96, max_new_tokens=8, dtype="fp32", admin_key=KEY,
                         peer_transport="nixl")
CLIENT = ServeClient(BASE, SETTINGS.served_model_name, KEY)
ADMIN = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def app():
    with served(SETTINGS):
        yield


def _stats():
    import ray

    from kvtier.actors.l3.namespace_actor import RAY_NAMESPACE, NamespaceClient

    shown = requests.get(f"{BASE}/admin/storage", headers=ADMIN, timeout=30).json()
    ns = shown["instances"][0]["l3"]["namespace"] if shown["instances"][0]["l3"] else None
    client = NamespaceClient(ray.get_actor(SETTINGS.l3_actor, namespace=RAY_NAMESPACE))
    return client, ns


def test_both_instances_lend_their_l2_and_answer_with_a_peer_tier(app):
    client, ns = _stats()
    eventually(lambda: client.stats(ns).peer_holders == 2, 30, "both instances are peers",
               interval_s=0.2)
    tokens = [random.Random(5).randrange(100, 40000) for _ in range(4 * 16 + 3)]
    first = CLIENT.complete(tokens)
    again = CLIENT.complete(tokens)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert set(again["kvtier"]["cached_tokens"]) == {"device", "host", "storage", "peer"}
    assert set(again["kvtier"]["route"]["expected_pages"]) == {
        "device_pages", "host_pages", "storage_pages", "peer_pages"}
    hashes = client.info(ns).spec.key_namespace.page_hashes(tokens, 16)
    eventually(lambda: [h.holder for h in client.l2_holders(ns, hashes)], 30,
               "the replica reports its L2", interval_s=0.2)


def test_detached_l3_takes_the_peers_off_the_list_and_attaching_brings_them_back(app):
    client, ns = _stats()
    off = requests.post(f"{BASE}/admin/storage/detach", headers=ADMIN, timeout=60)
    assert off.status_code == 200, off.text
    assert client.stats(ns).peer_holders == 0
    on = requests.post(f"{BASE}/admin/storage/attach", headers=ADMIN, timeout=60,
                       json={"backend": "file"})
    assert on.status_code == 200, on.text
    eventually(lambda: client.stats(ns).peer_holders == 2, 30, "both are peers again",
               interval_s=0.2)
