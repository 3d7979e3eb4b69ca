"""Several tenants in one deployment, for real: tenants by API key and by `cache_salt` share
the instance and its file L3 but never hit each other's prefixes, in L1, L2 or L3, while each
hits its own. The cache-level test (tests/tiers/test_tenant_isolation.py) sends 1,000 probes
per way of separating tenants; this one sends 400 through HTTP."""
from __future__ import annotations

import random

import pytest
import requests
from http_client import ServeClient
from shared_serve import BASE, served

from kvtier.frontend.settings import ServeSettings

ADMIN_KEY = "tenant-test-admin-key-0123"
KEYS = {"sk-acme-key-1": "acme", "sk-acme-key-2": "acme", "sk-globex-key": "globex"}
SETTINGS = ServeSettings(model="tiny", instances=1, page_size=16, chunk_tokens=64,
                         device_pages=96, max_new_tokens=8, dtype="fp32",
                         admin_key=ADMIN_KEY, api_keys=KEYS,
                         hicache={"prefetch_threshold_tokens": 16})  # short documents reach L3
MODEL = SETTINGS.served_model_name
CLIENT = ServeClient(BASE, MODEL, ADMIN_KEY)
_RNG = random.Random(3)
DOCS = [[_RNG.randrange(10, 40000) for _ in range(48)] for _ in range(6)]
PAGE = 16

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def app():
    with served(SETTINGS):
        yield


def cached(key: str | None, prompt: list[int], **kw) -> dict:
    return CLIENT.complete(prompt, 1, key, **kw)["kvtier"]["cached_tokens"]


def shared_pages(a: list[int], b: list[int]) -> int:
    """Tokens of the whole pages `a` and `b` share from the start (what one can hit of the
    other), short of each one's last token (a prompt's last token is always computed)."""
    n = 0
    while n < min(len(a), len(b)) - 1 and a[n] == b[n]:
        n += 1
    return n // PAGE * PAGE


def test_the_openai_endpoints_need_one_of_the_keys(app):
    for headers in ({}, {"Authorization": "Bearer sk-unknown-key"}):
        r = requests.get(f"{BASE}/v1/models", headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        r = requests.post(f"{BASE}/v1/completions", headers=headers, timeout=30,
                          json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 401, r.text
    r = requests.get(f"{BASE}/v1/models", timeout=30,
                     headers={"Authorization": "Bearer sk-globex-key"})
    assert r.status_code == 200, r.text


def test_tenants_never_hit_each_others_prefixes(app):
    """Tenant acme caches every document unsalted and with cache_salt "x"; globex (another
    key), globex with "x" (same salt, other tenant) and acme with "y" hit none of it: at most
    what their own earlier probes cached."""
    rng = random.Random(7)
    owners = (("sk-acme-key-1", None), ("sk-acme-key-1", "x"))  # (key, cache_salt)
    strangers = (("sk-globex-key", None), ("sk-globex-key", "x"), ("sk-acme-key-1", "y"))
    for key, salt in owners:  # each owner caches every document (L1, L2 and L3)
        for doc in DOCS:
            cached(key, doc + [1], **({"cache_salt": salt} if salt else {}))
    probes = 0
    sent: dict[tuple, list[list[int]]] = {who: [] for who in strangers}
    for phase in ("L1", "L3"):
        if phase == "L3":
            CLIENT.flush()  # L1 and L2 dropped: the owners' pages are in L3 only
        for i in range(66):
            doc = DOCS[i % len(DOCS)]
            cut = PAGE * rng.randrange(1, len(doc) // PAGE + 1)
            prompt = doc[:cut] + [rng.randrange(10, 40000) for _ in range(rng.randrange(1, 5))]
            for key, salt in strangers:
                hit = cached(key, prompt, **({"cache_salt": salt} if salt else {}))
                own = max((shared_pages(prompt, p) for p in sent[key, salt]), default=0)
                assert sum(hit.values()) <= own, (phase, i, key, salt, hit, own)
                sent[key, salt].append(prompt)  # a stranger may hit its own probes
                probes += 1
            if i % 3 == 0:  # an owner's own probe hits (the other acme key: same tenant)
                salt = owners[i % 2][1]
                hit = cached("sk-acme-key-2", prompt, **({"cache_salt": salt} if salt else {}))
                assert sum(hit.values()) >= cut - PAGE, (phase, i, hit)
                if phase == "L3" and i < 6 and cut > PAGE:
                    assert hit["storage"] > 0, (i, hit)
                probes += 1
    assert probes >= 400
