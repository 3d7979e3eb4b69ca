"""Pins through the namespace actor's client (the in-process service, no Ray): the same
records as the actor, a refusal crossing as a PinGrant and raised as PinRoomError."""
from __future__ import annotations

import pytest

from kvtier.actors.l3.namespace_actor import FakeNamespaceClient
from kvtier.errors import PinRoomError
from kvtier.kv_spec import HeadRange
from kvtier.messages import NamespaceSpec
from kvtier.policies import StorageBackendKind


def h(i: int, tag: str) -> str:
    return f"{tag}{i:063x}"


def test_pin_unpin_refresh_and_list_through_the_client():
    spec = NamespaceSpec("org/model", "", "fp", StorageBackendKind.SIMULATED, {}, 1, 8)
    with FakeNamespaceClient() as client:
        ns = client.register(spec).namespace
        a, b = [h(i, "a") for i in range(3)], [h(i, "b") for i in range(3)]
        client.report_stored(ns, a + b, HeadRange.of_rank(1))
        assert client.pin(ns, "pa", a, 30.0, 0.5, "acme") == 3
        with pytest.raises(PinRoomError, match="needs 3 pages, 1 free for pins in the L3") \
                as err:
            client.pin(ns, "pb", b, 30.0, 0.5)
        assert (err.value.needed_pages, err.value.free_pages) == (3, 1)
        assert client.refresh_pins(ns, ["pa"]) == 1
        [listed] = client.pins(ns)
        assert (listed.pin_id, listed.tenant, listed.pages) == ("pa", "acme", 3)
        stats = client.stats(ns)
        assert (stats.pins, stats.pinned_pages) == (1, 3)
        client.report_stored(ns, [h(i, "c") for i in range(8)], HeadRange.of_rank(1))  # quota pressure
        assert client.lookup(ns, a).hit_pages == 3
        assert client.unpin(ns, "pa") and not client.unpin(ns, "pa")
        assert client.stats(ns).pins == 0
