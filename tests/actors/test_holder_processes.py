"""L2 holders as real processes against the real namespace actor: a holder SIGKILLed is no
longer offered to readers once its lease ran out, and a new start under its name is listed;
in a rolling redeploy the old replica's shutdown leaves the new one listed. Each holder is a
process of its own that joins the cluster, lists pages through an L2Reporter and registers a
peer contact through a ContactKeeper, as an engine's scheduler and worker do."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvtier.actors.ray_env import cluster_address
from kvtier.messages import NamespaceSpec
from kvtier.policies import StorageBackendKind
from kvtier.tiers.l2_holders import HOLDER_TTL_S

ACTOR = "kvtier-holder-test"
KEYS = [f"{i:064x}" for i in range(1, 5)]
HOLDER = r'''
import sys, time
from kvtier.actors.l3.connector_link import DirectoryLink, register_peer
from kvtier.messages import PeerRank

from kvtier.actors.l3.rank_link import directory_client

address, namespace, actor, holder, incarnation = sys.argv[1:6]
keys = sys.argv[6].split(",")
from kvtier.actors.l3.connector_link import join
join(address)
info = directory_client(actor).info(namespace)
link = DirectoryLink(address, info, actor, holder, incarnation)
reporter = link.l2_reporter()
reporter.held(keys)
assert reporter.flush()
keeper = register_peer(address, info, holder, incarnation,
                       PeerRank(0, 1, 0, 2, holder, "ns", b"addr"), actor)
print("ready", flush=True)
if sys.stdin.readline().strip() == "close":  # a clean shutdown, as vLLM's
    keeper.close()
    reporter.close()
    print("closed", flush=True)
'''


@pytest.fixture(scope="module")
def directory(shared_ray, tmp_path_factory):
    from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor

    client = get_or_create_namespace_actor(ACTOR, str(tmp_path_factory.mktemp("state")))
    spec = NamespaceSpec("org/model", "", "fp", StorageBackendKind.FILE,
                         {"root_dir": str(tmp_path_factory.mktemp("l3"))}, 2, 0)
    namespace = client.register(spec).namespace
    yield client, namespace
    client.shutdown()


class HolderProcess:
    def __init__(self, namespace: str, name: str, incarnation: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(HOLDER), cluster_address(), namespace, ACTOR,
             name, incarnation, ",".join(KEYS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"the holder did not start: {line!r}"

    def close(self) -> None:
        self.proc.stdin.write("close\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "closed"
        self.proc.wait(30)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


def offered(client, namespace: str) -> str | None:
    offer = client.best_peer(namespace, KEYS, "reader")
    return None if offer.contact is None else offer.contact.holder


def test_a_killed_holder_expires_and_its_name_comes_back_with_a_new_start(directory):
    client, namespace = directory
    first = HolderProcess(namespace, "replica", "start-1")
    assert offered(client, namespace) == "replica"
    first.kill()
    killed_at = time.monotonic()
    while offered(client, namespace) is not None:
        assert time.monotonic() - killed_at < HOLDER_TTL_S + 20, \
            "a SIGKILLed holder was still offered long after its lease"
        time.sleep(0.5)
    second = HolderProcess(namespace, "replica", "start-2")  # the same name, started again
    try:
        assert offered(client, namespace) == "replica"
    finally:
        second.close()
    assert offered(client, namespace) is None


def test_the_old_replicas_shutdown_leaves_the_new_one_listed(directory):
    client, namespace = directory
    old = HolderProcess(namespace, "rolling", "old")
    new = HolderProcess(namespace, "rolling", "new")  # a rolling redeploy: both up a moment
    try:
        old.close()  # the old replica's shutdown forgets its own start only
        assert offered(client, namespace) == "rolling"
        time.sleep(3)  # a renewal interval and more: the new one keeps its listing
        assert offered(client, namespace) == "rolling"
    finally:
        new.close()


def test_the_connectors_calls_register_the_namespace_again_after_the_actor_lost_it(
        shared_ray, tmp_path):
    """The namespace actor killed with its state lost: the next directory call of a
    connector's link registers the namespace again and goes on (a lookup, a report)."""
    import shutil

    from kvtier.actors.l3.connector_link import DirectoryLink, WorkerStorage
    from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
    from kvtier.kv_spec import HeadRange

    state = tmp_path / "state"
    client = get_or_create_namespace_actor("kvtier-relost", str(state))
    try:
        spec = NamespaceSpec("org/model", "", "fp", StorageBackendKind.FILE,
                             {"root_dir": str(tmp_path / "l3")}, 2, 64)
        info = client.register(spec)
        link = DirectoryLink(cluster_address(), info, "kvtier-relost", "h", "i")
        storage = WorkerStorage(cluster_address(), info, HeadRange(0, 2, 2), "kvtier-relost")
        shutil.rmtree(state)
        client.kill()  # Ray restarts it, knowing no namespace
        deadline = time.monotonic() + 60
        while True:  # until the restarted actor answers, knowing no namespace (the old one
            try:  # may answer once more before it dies)
                if client.namespaces() == []:
                    break
            except Exception:  # noqa: BLE001 - restarting
                pass
            assert time.monotonic() < deadline, "the namespace actor did not come back empty"
            time.sleep(0.5)
        assert link.lookup(KEYS) == (0, "")  # answered (a miss), not an error
        assert client.namespaces() == [info.namespace]  # registered again by the call
        storage.report_stored(KEYS[:1])  # (two heads: one rank's report publishes nothing)
        storage.close()
    finally:
        client.shutdown()
