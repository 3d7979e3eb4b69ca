"""Pinned prefixes on the served graph: one instance of the tiny model at TP=2 over a bounded
file L3. A chat prefix pinned through POST /admin/pin survives a flood that evicts an
unpinned one of the same size, and a later chat request with the same leading messages hits
it from L2; the L3 namespace holds it too; bad bodies and a missing key are 4xx, a pin that
does not fit is a 409 saying how much room is missing, DELETE unpins, a short TTL lapses.

Why these settings: 24 L1 and 48 L2 pages of 16 tokens per rank and an L3 bound of 48 pages,
so eight 15-page prompts cycle every tier; pins may take a quarter of each (12 pages)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import requests
from eventually import eventually
from http_client import ServeClient
from prometheus_client.parser import text_string_to_metric_families
from shared_serve import BASE, served
from test_serve_metrics import PAGE, SETTINGS as METRICS_SETTINGS

KEY = "test-admin-key-pins-0123456789"
ADMIN = {"Authorization": f"Bearer {KEY}"}
# the metrics test's tiers (24 L1 and 48 L2 pages of 16 tokens, a 48-page L3), the default
# prefetch threshold, pins on a quarter of each
SETTINGS = dataclasses.replace(METRICS_SETTINGS, admin_key=KEY, hicache={},
                               pin_max_fraction=0.25)
MODEL = SETTINGS.served_model_name
CLIENT = ServeClient(BASE, MODEL, KEY)
SYSTEM = [{"role": "system", "content": "You are the archivist of the kvtier project. Answer "
                                        "in one line and cite the record number. " * 5}]
CONTROL = [{"role": "system", "content": "Records clerk here: quote the ledger line first, then "
                                         "say nothing else unless asked twice. " * 5}]
WAIT_S = 30.0

pytestmark = pytest.mark.timeout(300)
_rng = random.Random(11)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    l3 = tmp_path_factory.mktemp("l3")
    with served(dataclasses.replace(SETTINGS, l3_root=str(l3))) as pids:
        yield pids


def pin(body: dict, method: str = "post", headers: dict | None = ADMIN) -> requests.Response:
    return getattr(requests, method)(f"{BASE}/admin/pin", json=body, headers=headers,
                                     timeout=120)


def listed() -> list[dict]:
    r = CLIENT.get("/admin/pin", admin=True, timeout_s=60)
    assert r.status_code == 200, r.text
    return r.json()["pins"]


def flood(prompts: int = 8) -> None:
    """Prompts of 15 fresh pages each: 120 pages through every tier."""
    for _ in range(prompts):
        CLIENT.answer("/v1/completions", {
            "model": MODEL, "prompt": [_rng.randrange(1, 250) for _ in range(15 * PAGE)],
            "max_tokens": 1})


def gauge(name: str, **labels: str) -> float:
    text = CLIENT.metrics()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == f"kvtier_{name}" and labels.items() <= s.labels.items():
                return s.value
    return -1.0


def wait_gauge(name: str, value: float, **labels: str) -> None:
    def there() -> bool:
        assert (now := gauge(name, **labels)) == value, f"{name}{labels} is {now}"
        return True

    # the ingress folds snapshots in every 2 s
    eventually(there, WAIT_S, f"{name} reached {value}", retry_on=(AssertionError,),
               interval_s=0.5)


def test_requests_without_the_admin_key_or_with_bad_bodies_are_refused(app):
    for method in ("post", "delete", "get"):
        assert pin({"tokens": [1] * 32, "ttl_s": 5}, method, headers={}).status_code == 401
        wrong = {"Authorization": "Bearer not-the-key-0123456789"}
        assert pin({"tokens": [1] * 32, "ttl_s": 5}, method, headers=wrong).status_code == 401
    for body, needle in [({"ttl_s": 5}, "either tokens"),
                         ({"tokens": [1] * 32, "messages": SYSTEM, "ttl_s": 5}, "exactly one"),
                         ({"tokens": [1, "x"], "ttl_s": 5}, "tokens[1]"),
                         ({"tokens": [1] * 32, "ttl_s": 0}, "ttl_s"),
                         ({"tokens": [1] * 32, "ttl_s": 10**9}, "ttl_s"),
                         ({"tokens": [1] * 32}, "ttl_s"),
                         ({"tokens": [1] * 32, "ttl_s": 5, "extra": 1}, "unknown field"),
                         ({"tokens": [1] * 32, "ttl_s": 5, "tenant": "nobody"}, "tenant"),
                         ({"tokens": [1] * 8, "ttl_s": 5}, "shorter than one page"),
                         ({"tokens": [10**8] * 32, "ttl_s": 5}, "vocabulary")]:
        r = pin(body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
    gone = pin({"id": "0123456789abcdef"}, "delete")
    assert gone.status_code == 404 and "no pin" in gone.json()["error"]["message"]


def test_a_pinned_chat_prefix_survives_a_flood_and_still_hits(app):
    made = pin({"messages": SYSTEM, "ttl_s": 600})
    assert made.status_code == 200, made.text
    pinned = made.json()
    pages = pinned["pages"]
    assert pinned["prefilled"] and 5 <= pages <= 11, pinned  # nothing held it: computed first
    assert pinned["instances"] == {"instance-0": pages}
    assert pinned["l3_pages"] == pages  # the backups were waited for: L3 really holds it
    [entry] = listed()
    assert (entry["id"], entry["pages"], entry["l3_pages"]) == (pinned["id"], pages, pages)
    assert entry["instances"]["instance-0"]["host_pages"] == pages
    CLIENT.chat(CONTROL + [{"role": "user", "content": "Record 3?"}], 2)  # cached, not pinned

    flood()
    # more messages after it
    hit = CLIENT.chat(SYSTEM + [{"role": "user", "content": "Record 7?"}], 2)
    cached = hit["kvtier"]["cached_tokens"]
    assert cached["device"] + cached["host"] >= pages * PAGE, hit["kvtier"]  # from L2
    control = CLIENT.chat(CONTROL + [{"role": "user", "content": "Record 3?"}], 2)
    assert sum(control["kvtier"]["cached_tokens"].values()) < PAGE, control["kvtier"]  # evicted

    assert gauge("cached_tokens_total", kvtier_instance="instance-0", tier="host") >= \
        pages * PAGE  # the metrics show the L2 hit too
    wait_gauge("pins", 1, kvtier_instance="instance-0")
    wait_gauge("pinned_pages", pages, kvtier_instance="instance-0", tier="host")
    wait_gauge("l3_pinned_pages", pages)

    # a 12-page prefix does not fit next to it in a quarter of L2 (12 pages)
    tokens = [_rng.randrange(1, 250) for _ in range(12 * PAGE)]
    refused = pin({"tokens": tokens, "ttl_s": 60})
    assert refused.status_code == 409, refused.text
    assert f"needs 12 pages, {12 - pages} free for pins in L2 of instance instance-0" in \
        refused.json()["error"]["message"]
    assert [p["id"] for p in listed()] == [pinned["id"]]  # nothing half-pinned

    out = pin({"messages": SYSTEM, "ttl_s": 600}, "delete")
    assert out.status_code == 200 and out.json()["unpinned"]["l3"], out.text
    assert listed() == []
    assert pin({"id": pinned["id"]}, "delete").status_code == 404
    wait_gauge("pinned_pages", 0, kvtier_instance="instance-0", tier="host")


def test_a_pin_with_a_short_ttl_lapses_by_itself(app):
    tokens = [_rng.randrange(1, 250) for _ in range(4 * PAGE)]
    made = pin({"tokens": tokens, "ttl_s": 2, "cache_salt": "short"})
    assert made.status_code == 200 and made.json()["pages"] == 4, made.text
    assert [p["id"] for p in listed()] == [made.json()["id"]]
    def lapsed() -> bool:
        assert not (pins := listed()), pins
        return True

    # every tier drops it on its own clock: the ranks, the L3 directory
    eventually(lapsed, WAIT_S, "the pin lapsed", retry_on=(AssertionError,), interval_s=0.5)
    wait_gauge("pins", 0, kvtier_instance="instance-0")
