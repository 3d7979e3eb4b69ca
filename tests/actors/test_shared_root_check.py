"""The shared-root check of a file or nixl namespace: the namespace actor writes a marker into
root_dir at registration, every rank reads it back before it attaches. A rank whose view of
root_dir lacks it (a node-local directory on another host, simulated here with another
directory or a removed marker) is refused with the fix; one host passes."""
from __future__ import annotations

import dataclasses
import socket

import pytest
import torch

from kvtier.actors.l3.namespace_actor import FakeNamespaceClient
from kvtier.actors.rank_actor import Rank, RankSettings
from kvtier.backends.shared_root import MARKER_PREFIX, RootNotShared
from kvtier.config import HiCacheConfig
from kvtier.cli.demo import namespace_spec
from kvtier.engine.weight_sources import TinyWeights
from kvtier.messages import NamespaceSpec
from kvtier.tiers.page_store import open_rank_backend

PAGE = 16
CONFIG = HiCacheConfig(page_size=PAGE)
SETTINGS = RankSettings(TinyWeights(seed=4), CONFIG, device_pages=16, dtype=torch.float32,
                        chunk_tokens=PAGE, tenant_salt="shared-root")
REFUSAL = r"root_dir .*a filesystem mounted on every node"


def spec_for(kind: str, root) -> NamespaceSpec:
    return NamespaceSpec("org/model", "shared-root", "fp", kind, {"root_dir": str(root)}, 1)


def elsewhere(info, root):
    """`info` as a rank on a node whose root_dir is another (local) directory sees it."""
    return dataclasses.replace(info, options={**info.options, "root_dir": str(root)})


@pytest.mark.parametrize("kind", ["file", "nixl"])
def test_a_rank_that_does_not_see_the_actors_root_is_refused(tmp_path, kind):
    with FakeNamespaceClient() as client:
        info = client.register(spec_for(kind, tmp_path / "head"))
        marker = tmp_path / "head" / f"{MARKER_PREFIX}{info.namespace}"
        assert info.root_marker and marker.read_text().split()[-1] == info.root_marker
        (tmp_path / "node-b").mkdir()
        with pytest.raises(RootNotShared, match=REFUSAL) as err:
            open_rank_backend(elsewhere(info, tmp_path / "node-b"), node="node-b")
        assert str(tmp_path / "node-b") in str(err.value) and "node-b" in str(err.value)


def test_one_host_passes_and_a_removed_marker_is_refused_until_registered_again(tmp_path):
    with FakeNamespaceClient() as client:
        spec = spec_for("file", tmp_path / "l3")
        info = client.register(spec)
        with open_rank_backend(info):  # the same directory: passes
            pass
        (tmp_path / "l3" / f"{MARKER_PREFIX}{info.namespace}").unlink()
        with pytest.raises(RootNotShared, match="has no marker"):
            open_rank_backend(info)
        assert client.register(spec) == info  # registering again puts the same marker back
        with open_rank_backend(info):
            pass
        assert client.service.rebuild(info.namespace) == 0  # the marker is no page


def test_a_restarted_actor_keeps_the_marker(tmp_path):
    spec = spec_for("file", tmp_path / "l3")
    with FakeNamespaceClient(str(tmp_path / "state")) as first:
        info = first.register(spec)
    with FakeNamespaceClient(str(tmp_path / "state")) as second:  # as after a restart
        again = second.info(spec.namespace)
        assert again.root_marker == info.root_marker
        with open_rank_backend(again):
            pass


def test_a_rank_actor_checks_before_it_attaches(tmp_path):
    spec = namespace_spec(SETTINGS.source, CONFIG, "file", str(tmp_path / "head"), "tiny",
                          "shared-root", dtype=SETTINGS.dtype, page_size=PAGE)
    with FakeNamespaceClient() as client:
        info = client.register(spec)
        rank = Rank(0, 1, "", SETTINGS)
        try:
            (tmp_path / "node-b").mkdir()
            with pytest.raises(RootNotShared, match=REFUSAL) as err:
                rank.attach_l3(elsewhere(info, tmp_path / "node-b").to_msgpack(), None)
            assert socket.gethostname() in str(err.value)  # the rank's node, by name
            assert rank.engine.cache.storage is None  # nothing attached
            assert rank.attach_l3(info.to_msgpack(), None) == "file"  # its own root: fine
            rank.detach_l3()
        finally:
            rank.close()
