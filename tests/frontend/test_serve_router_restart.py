"""A router that starts again rebuilds its prefix index from the instances, for kvtier's own
engine: two instances of the tiny model, a document of several full pages asked once, the
router's replica killed. Serve starts another router, whose first poll of each instance asks
what it holds (`poll(full=True)`), so the document asked again goes to its holder and hits its
device pages. tests/vllm_engine/test_serve_vllm.py shows the same for vLLM engines.

Its own graph on the shared cluster (shared_serve.py), deleted after the module: the killed
router is no other module's."""
from __future__ import annotations

import random

import pytest
from eventually import eventually
from http_client import ServeClient
from shared_serve import BASE, served

from kvtier.frontend.settings import ServeSettings

KEY = "test-admin-key-router-restart-0123"
PAGE = 16
SETTINGS = ServeSettings(model="tiny", instances=2, page_size=PAGE, chunk_tokens=64,
                         device_pages=96, max_new_tokens=8, dtype="fp32", admin_key=KEY,
                         storage_backend=None)
CLIENT = ServeClient(BASE, SETTINGS.served_model_name, KEY)
PROMPT = 100  # tokens: six full pages can be reused ((100 - 1) // 16 = 6)
PAGES = (PROMPT - 1) // PAGE
REUSABLE = PAGES * PAGE

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def app():
    with served(SETTINGS):
        yield


def document(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 40000) for _ in range(PROMPT)]


def settled(holder: str) -> None:
    """Until the router saw every instance idle and `holder` holding the document's pages."""
    def quiet() -> bool:
        shown = CLIENT.router()
        assert all(i["load"] == 0 for i in shown.values()), shown
        assert shown[holder]["indexed_pages"] >= PAGES, shown
        return True

    eventually(quiet, 30, "the router saw every instance idle and the holder's pages",
               retry_on=(AssertionError,), interval_s=0.1)


def routers() -> list[dict]:
    """The router's replica actors (Serve names each one anew)."""
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if "RouterDeployment" in a["name"]]


def test_a_router_that_starts_again_rebuilds_its_index_from_the_instances(app):
    import ray

    doc = document(1)
    first = CLIENT.complete(doc)
    holder = first["kvtier"]["instance"]
    settled(holder)
    (old,) = routers()
    ray.kill(ray.get_actor(old["name"], namespace=old["namespace"]), no_restart=True)
    eventually(lambda: [a for a in routers() if a["name"] != old["name"]], 120,
               "Serve started another router")

    def rebuilt() -> bool:
        shown = CLIENT.router()
        assert shown[holder]["indexed_pages"] >= PAGES, shown
        return True

    # until the new router answers and indexed the holder's pages
    eventually(rebuilt, 120, "the new router indexed the holder's pages",
               retry_on=(AssertionError, OSError), interval_s=0.5)
    again = CLIENT.complete(doc)
    assert again["kvtier"]["instance"] == holder, again["kvtier"]["route"]
    assert again["kvtier"]["cached_tokens"]["device"] == REUSABLE, again["kvtier"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
