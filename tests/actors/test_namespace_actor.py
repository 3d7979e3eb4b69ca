"""The L3 namespace service (no Ray), then the real actor on a local 2-CPU Ray cluster."""
from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
import torch
from eventually import eventually

from kvtier.actors.l3.namespace_actor import (FakeNamespaceClient, NamespaceUnavailable,
                                              get_or_create_namespace_actor)
from kvtier.actors.l3.namespace_service import STATE_FILE
from kvtier.actors.ray_env import LOOPBACK, shutdown_local_ray, start_local_ray
from kvtier.errors import ConfigError
from kvtier.kv_spec import HeadRange, KVSpec
from kvtier.messages import NamespaceSpec
from kvtier.policies import MemLayout
from kvtier.tiers.host_pool import HostPool
from kvtier.tiers.page_store import open_rank_backend
from kvtier.netcheck import descendants, listening

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float32)
TOKENS = list(range(40))


def file_spec(root, kv_heads=2, **kw) -> NamespaceSpec:
    return NamespaceSpec("org/model", "tenant", "fp", "file", {"root_dir": str(root)}, kv_heads,
                         **kw)


def head(rank: int) -> HeadRange:
    """What TP rank `rank` of 2 owns of the model's 2 KV heads."""
    return HeadRange(rank, rank + 1, 2)


def store_pages(info, rank: int, pages: list[str]) -> None:
    """What a rank actor does: write its heads of `pages` with its own backend client."""
    with HostPool(SPEC, len(pages), MemLayout.PAGE_HEAD) as pool, \
            open_rank_backend(info, head(rank)) as backend:
        pool.kv.copy_(torch.randn(pool.kv.shape))
        backend.register_pool("kv", pool)
        assert all(backend.set_from("kv", pages, list(range(len(pages)))).ok)


def pages_of(spec: NamespaceSpec) -> list[str]:
    return spec.key_namespace.page_hashes(TOKENS, SPEC.page_size)


# ---- the service through the fake client (no Ray) ----------------------------------------

def test_fake_client_speaks_the_same_records(tmp_path):
    spec = file_spec(tmp_path / "l3", max_pages=100)
    client = FakeNamespaceClient()
    try:
        info = client.register(spec)
        assert info.namespace == spec.namespace and client.namespaces() == [spec.namespace]
        assert client.info(spec.namespace) == info
        pages = pages_of(spec)
        for rank in (0, 1):
            store_pages(info, rank, pages)
        assert client.report_stored(info.namespace, pages, head(0)) == []
        assert client.report_stored(info.namespace, pages, head(1)) == pages
        res = client.lookup(info.namespace, pages, lease_ttl_s=5)
        assert res.hit_pages == len(pages) and res.lease_id
        assert client.release(res.lease_id)
        grant = client.lease(info.namespace, pages[:3], ttl_s=5)
        assert grant.pages == 3
        stats = client.stats(info.namespace)
        assert stats.published_pages == len(pages) and stats.leases_granted == 2
    finally:
        client.close()


def test_registered_namespaces_persist_and_rebuild_from_storage(tmp_path):
    state, spec = tmp_path / "state", file_spec(tmp_path / "l3")
    first = FakeNamespaceClient(str(state))
    info = first.register(spec)
    pages = pages_of(spec)
    for rank in (0, 1):
        store_pages(info, rank, pages)
    first.report_stored(info.namespace, pages, head(0))
    first.report_stored(info.namespace, pages, head(1))
    first.close()
    saved = json.loads((state / STATE_FILE).read_text())
    assert saved["namespaces"][0]["model"] == "org/model"
    second = FakeNamespaceClient(str(state))  # as after an actor restart
    try:
        assert second.namespaces() == [spec.namespace]
        assert second.lookup(spec.namespace, pages).hit_pages == len(pages)
        assert second.stats(spec.namespace).rebuilt_pages == len(pages)
    finally:
        second.close()


def test_an_old_format_namespace_in_the_state_file_is_dropped(tmp_path, caplog):
    """A namespace an earlier version registered (a TP size, objects named by rank) is not
    restored, and not kept: its objects are reclaimed by the model's new namespace."""
    new = file_spec(tmp_path / "l3")
    old = {**new.to_map(), "tp_size": 2}
    del old["kv_heads"]
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / STATE_FILE).write_text(json.dumps(
        {"version": 1, "namespaces": [old, new.to_map()], "epochs": {}, "masters": {}}))
    client = FakeNamespaceClient(str(tmp_path / "state"))
    try:
        assert client.namespaces() == [new.namespace]
        assert "old object format" in caplog.text
        saved = json.loads((tmp_path / "state" / STATE_FILE).read_text())
        assert [n.get("tp_size") for n in saved["namespaces"]] == [None]
    finally:
        client.close()


def test_a_broken_state_file_starts_empty(tmp_path, caplog):
    (tmp_path / STATE_FILE).write_text("{not json")
    client = FakeNamespaceClient(str(tmp_path))
    assert client.namespaces() == []
    assert "register them again" in caplog.text
    client.close()


def test_a_dead_mooncake_master_is_restarted_with_a_new_epoch():
    pytest.importorskip("mooncake.store")
    spec = NamespaceSpec("org/model", "t", "fp", "mooncake",
                         {"global_segment_size_bytes": 0, "local_buffer_size_bytes": 0})
    client = FakeNamespaceClient()
    try:
        info = client.register(spec)
        first = info.options["master_address"]
        assert first.startswith(f"{LOOPBACK}:") and info.epoch == 1
        master = client.service._masters[spec.namespace]
        assert {ip for ip, _, _ in listening({master.pid})} == {LOOPBACK}
        master.proc.kill()
        master.proc.wait(5)
        assert client.service.supervise() == 1
        again = client.info(spec.namespace)
        assert again.epoch == 2 and again.options["master_address"] != first
        assert client.service._masters[spec.namespace].alive()
    finally:
        client.close()
    assert not client.service._masters


# ---- the Ray actor -----------------------------------------------------------------------

class RayCluster:
    """The cluster of this module and the processes it started (GCS, raylet, workers)."""

    def __init__(self) -> None:
        self.before = descendants(os.getpid())  # e.g. a Mooncake master of another test module
        self.ctx = start_local_ray(num_cpus=2)

    def pids(self) -> set[int]:
        return descendants(os.getpid()) - self.before


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = RayCluster()
    yield cluster
    shutdown_local_ray()


@pytest.fixture(scope="module")
def actor(ray_cluster, tmp_path_factory):
    name = f"kvtier-l3-test-{uuid.uuid4().hex[:6]}"
    client = get_or_create_namespace_actor(name, str(tmp_path_factory.mktemp("l3-state")))
    yield name, client
    client.shutdown()  # a no-op when the last test already shut the cluster down


def test_start_local_ray_refuses_a_second_cluster(ray_cluster):
    with pytest.raises(RuntimeError, match="already initialized"):
        start_local_ray(1)


def test_the_actor_is_named_detached_and_shared(actor, tmp_path_factory):
    import ray
    import ray._private.state as ray_state  # the GCS table: no dashboard needed

    name, one = actor
    two = get_or_create_namespace_actor(name)  # a second client finds the same actor
    assert one.ping() == two.ping()
    row = next(a for a in ray_state.actors().values() if a["Name"] == name)
    assert row["IsDetached"] and row["State"] == "ALIVE"
    assert {"name": name, "namespace": "kvtier"} in ray.util.list_named_actors(all_namespaces=True)

    spec = file_spec(tmp_path_factory.mktemp("l3"))
    info = one.register(spec)
    assert two.register(spec) == info
    with pytest.raises(ConfigError, match="already registered"):  # the actor's own error
        two.register(file_spec(tmp_path_factory.mktemp("l3"), kv_heads=4))
    pages = pages_of(spec)
    store_pages(info, 0, pages)
    store_pages(info, 1, pages)
    assert one.report_stored(info.namespace, pages, head(0)) == []
    assert two.report_stored(info.namespace, pages, head(1)) == pages  # the same directory
    assert one.lookup(info.namespace, pages).hit_pages == len(pages)


def test_a_killed_actor_comes_back_and_rebuilds_from_the_file_backend(actor):
    import ray

    name, client = actor
    ns = client.namespaces()[0]
    before = client.ping()
    pages = client.info(ns).spec.key_namespace.page_hashes(TOKENS, SPEC.page_size)
    ray.kill(client.handle, no_restart=False)
    # the kill is asynchronous: wait for a new incarnation
    eventually(lambda: client.wait_ready(timeout_s=60) != before, 60,
               "the killed namespace actor came back", interval_s=0.1)
    assert client.namespaces() == [ns]
    assert client.lookup(ns, pages).hit_pages == len(pages)
    assert client.stats(ns).rebuilt_pages == len(pages)


def test_after_a_failed_call_calls_fail_at_once_until_the_actor_answers(actor):
    """A rank's client (its short timeout) waits out one timeout per outage: then calls fail
    without waiting until the actor answers the ping sent at the failure, and go through as
    soon as it does (no back-off to wait out). On the old client every call after each
    back-off waited the timeout again, inside the rank's step."""
    import ray

    from kvtier.actors.l3.namespace_actor import NamespaceClient
    from kvtier.actors.l3.rank_link import RANK_CALL_TIMEOUT_S

    name, client = actor
    ns = client.namespaces()[0]
    quick = NamespaceClient(client.handle, RANK_CALL_TIMEOUT_S)
    before = client.ping()
    waited, at_once = [], []

    def answered() -> bool:
        start = time.monotonic()
        try:
            quick.info(ns)
            return True
        except NamespaceUnavailable as exc:
            (at_once if "has not answered" in str(exc) else waited).append(
                time.monotonic() - start)
            return False

    ray.kill(client.handle, no_restart=False)  # asynchronous: calls may go through at first
    eventually(lambda: answered() and (waited or at_once), 90,
               "the rank's client failed calls, then called again once the actor was back",
               interval_s=0.05)
    assert client.ping() != before  # a new incarnation answered
    assert quick.info(ns).namespace == ns
    assert at_once, (waited, at_once)  # the outage was seen, and calls did not wait in it
    assert len(waited) < len(at_once), (waited, at_once)


def test_ray_listens_on_loopback_only(ray_cluster):
    # Ray's own processes only: the driver (this process) may hold other tests' sockets.
    found = listening(ray_cluster.pids())
    assert len({pid for _, _, pid in found}) >= 3, found  # GCS, raylet, workers, agents
    assert all(ip in (LOOPBACK, "::1") for ip, _, _ in found), found


def test_shutdown_removes_the_actor_and_the_cluster_processes(ray_cluster, actor):
    import ray

    name, client = actor
    client.shutdown()

    def deregistered() -> bool:
        try:
            ray.get_actor(name, namespace="kvtier")
        except ValueError:
            return True
        return False

    eventually(deregistered, 10, "the namespace actor was deregistered after shutdown",
               interval_s=0.1)
    with pytest.raises(NamespaceUnavailable):
        client.ping()
    children = ray_cluster.pids()
    assert children
    shutdown_local_ray()
    try:
        eventually(lambda: not children & ray_cluster.pids(), 15,
                   "Ray's processes exited after shutdown", interval_s=0.2)
    finally:
        for pid in children & ray_cluster.pids():  # do not leak them into the next module
            os.kill(pid, signal.SIGKILL)
