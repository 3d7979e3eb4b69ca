"""The nixl backend (NIXL POSIX plugin): exact round trips, never-overwrite, verification,
capacity, restart, the file format it shares with the file backend, and reads pipelined in
chunks (a failed or hung chunk, damage found on either thread, every file closed)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl")

from kvtier.backends.base import KV_POOL, PagePart, StorageTarget, StorageUnavailable  # noqa: E402
from kvtier.backends.registry import create_backend  # noqa: E402
from kvtier.errors import CacheUsageError, ConfigError  # noqa: E402
from kvtier.keys import KeyNamespace, page_hashes  # noqa: E402
from kvtier.kv_spec import KVSpec  # noqa: E402
from kvtier.policies import MemLayout  # noqa: E402
from kvtier.storage_options import NixlOptions  # noqa: E402
from kvtier.tiers.host_pool import HostPool  # noqa: E402

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.bfloat16)
PART_BYTES = SPEC.page_part_bytes
NS = KeyNamespace("nixl-test", "t0", "fp1")


def keys(n: int, salt: int = 0) -> list[str]:
    return page_hashes(list(range(salt, salt + 4 * n)), 4)


def make_pool(pages: int = 16, seed: int = 0) -> HostPool:
    pool = HostPool(SPEC, pages, MemLayout.PAGE_HEAD)
    gen = torch.Generator().manual_seed(seed)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(pool.kv.dtype))
    return pool


def same(pool: HostPool, a: int, b: int) -> bool:
    return all(torch.equal(pool.page_part_view(a, p), pool.page_part_view(b, p)) for p in (0, 1))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "l3"


@pytest.fixture
def open_backend(root):
    made = []

    def make(kind: str = "nixl", **options):
        b = create_backend(kind, StorageTarget(NS), {"root_dir": str(root), **options})
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def path_of(root: Path, b, key: str, part: PagePart = PagePart.K) -> Path:
    return root / b.target.object_name(KV_POOL, key, 0, part)


def test_round_trip_is_exact_and_one_transfer_per_batch(open_backend, monkeypatch):
    pool = make_pool()
    b = open_backend()
    b.register_pool(KV_POOL, pool)
    calls = []
    real = b.agent.transfer
    monkeypatch.setattr(b.agent, "transfer", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    ks = keys(5)
    res = b.set_from(KV_POOL, ks, [3, 1, 4, 0, 9])
    assert res.ok == [True] * 5 and res.bytes_moved == 5 * 2 * PART_BYTES
    res = b.get_into(KV_POOL, ks, [10, 11, 12, 13, 14])
    assert res.ok == [True] * 5 and res.bytes_moved == 5 * 2 * PART_BYTES
    assert calls == ["WRITE", "READ"]
    assert len(b.agent._dram) == 1  # the pool was registered once, not per transfer
    for s, d in zip([3, 1, 4, 0, 9], [10, 11, 12, 13, 14]):
        assert same(pool, s, d)
    assert b.capabilities.zero_copy and b.capabilities.verified and b.capabilities.bounded


def test_calls_larger_than_a_request_split_into_whole_requests(open_backend, monkeypatch):
    import kvtier.backends.nixl_backend as nb
    monkeypatch.setattr(nb, "MAX_OBJECTS_PER_TRANSFER", 4)  # 2 pages of 2 objects (1 head)
    pool = make_pool()
    b = open_backend()
    b.register_pool(KV_POOL, pool)
    calls = []
    real = b.agent.transfer
    monkeypatch.setattr(b.agent, "transfer",
                        lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    ks = keys(5)
    assert b.set_from(KV_POOL, ks, [0, 1, 2, 3, 4]).ok == [True] * 5
    assert b.get_into(KV_POOL, ks, [5, 6, 7, 8, 9]).ok == [True] * 5
    assert calls == [4, 4, 2, 4, 4, 2]  # descriptors per request: 1 head x 2 parts per page
    assert all(same(pool, i, 5 + i) for i in range(5))


def open_fds() -> int:
    """This process's open descriptors of object files (names under a kvtier-named
    directory): other descriptors come and go with the libraries' own threads (a Mooncake
    client of an earlier test reconnecting, sockets), which says nothing of the backend's."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        held += f"/{NS.name}/" in target
    return held


@pytest.fixture
def chunked(monkeypatch):
    """Reads pipelined in chunks of 2 pages (1 head x 2 parts: 4 objects per request)."""
    import kvtier.backends.nixl_backend as nb
    monkeypatch.setattr(nb, "READ_CHUNK_BYTES", 2 * 2 * PART_BYTES)


def count_requests(b, monkeypatch, fail_read: int = 0) -> list[tuple[str, int]]:
    """Records (op, objects) per NIXL request; the `fail_read`-th read request (1-based)
    reports a NIXL error instead of moving anything."""
    calls: list[tuple[str, int]] = []
    real = b.agent.transfer

    def counted(op, mem, files, timeout_s):
        calls.append((op, len(mem)))
        if op == "READ" and sum(c[0] == "READ" for c in calls) == fail_read:
            return False
        return real(op, mem, files, timeout_s)
    monkeypatch.setattr(b.agent, "transfer", counted)
    return calls


@pytest.mark.parametrize("verify", [True, False])
def test_large_reads_pipeline_chunks_of_pages(open_backend, monkeypatch, chunked, verify):
    pool = make_pool()
    b = open_backend(verify_checksums=verify)
    b.register_pool(KV_POOL, pool)
    ks = keys(5)
    assert b.set_from(KV_POOL, ks, [0, 1, 2, 3, 4]).ok == [True] * 5
    calls = count_requests(b, monkeypatch)
    before = open_fds()
    res = b.get_into(KV_POOL, ks, [8, 9, 10, 11, 12])
    assert res.ok == [True] * 5 and res.bytes_moved == 5 * 2 * PART_BYTES
    assert calls == [("READ", 4), ("READ", 4), ("READ", 2)]  # whole pages per request
    assert all(same(pool, i, 8 + i) for i in range(5))
    assert open_fds() == before


def test_a_failed_chunk_is_misses_the_others_hits(open_backend, monkeypatch, chunked):
    pool = make_pool()
    b = open_backend()
    b.register_pool(KV_POOL, pool)
    ks = keys(5)
    b.set_from(KV_POOL, ks, [0, 1, 2, 3, 4])
    calls = count_requests(b, monkeypatch, fail_read=2)
    before = open_fds()
    res = b.get_into(KV_POOL, ks, [8, 9, 10, 11, 12])
    assert res.ok == [True, True, False, False, True]  # pages 2 and 3 rode the failed request
    assert res.bytes_moved == 3 * 2 * PART_BYTES and len(calls) == 3
    assert same(pool, 0, 8) and same(pool, 1, 9) and same(pool, 4, 12)
    assert open_fds() == before and b.stats().corrupt_objects == 0
    assert b.exists(ks).usable_pages == 5  # a failed request removes nothing
    calls.clear()
    assert b.get_into(KV_POOL, ks[2:4], [10, 11]).ok == [True, True]
    assert same(pool, 2, 10) and same(pool, 3, 11)


@pytest.mark.parametrize("where", [0, 2, 4])  # verified on the helper (0, 2) or at the end (4)
def test_damage_in_any_chunk_is_a_miss_and_removed(open_backend, monkeypatch, chunked, where):
    pool = make_pool()
    b = open_backend()
    b.register_pool(KV_POOL, pool)
    ks = keys(5)
    b.set_from(KV_POOL, ks, [0, 1, 2, 3, 4])
    flipped = path_of(Path(b.root), b, ks[where], PagePart.V)
    damage_object(flipped, "flip_payload")
    foreign = path_of(Path(b.root), b, ks[3], PagePart.K)
    damage_object(foreign, "flip_header_name")  # found while the helper opens a chunk
    before = open_fds()
    res = b.get_into(KV_POOL, ks, [8, 9, 10, 11, 12])
    assert res.ok == [i not in (where, 3) for i in range(5)]
    assert all(same(pool, i, 8 + i) for i in range(5) if res.ok[i])
    assert b.stats().corrupt_objects == 2 and not flipped.exists() and not foreign.exists()
    assert open_fds() == before
    assert b.exists(ks).usable_pages == (where if where < 3 else 3)


def test_unverified_chunked_reads_hash_nothing(open_backend, monkeypatch, chunked):
    import kvtier.backends.nixl_backend as nb
    pool = make_pool()
    b = open_backend(verify_checksums=False)
    b.register_pool(KV_POOL, pool)
    ks = keys(5)
    b.set_from(KV_POOL, ks, [0, 1, 2, 3, 4])
    monkeypatch.setattr(nb, "_hash_all", lambda views: pytest.fail("a read hashed its pages"))
    monkeypatch.setattr(b, "_checksums", lambda views: pytest.fail("a read hashed its pages"))
    assert b.get_into(KV_POOL, ks, [8, 9, 10, 11, 12]).ok == [True] * 5


def test_existing_pages_are_skipped_never_overwritten(open_backend):
    pool = make_pool()
    b = open_backend()
    b.register_pool(KV_POOL, pool)
    k = keys(2)
    assert b.set_from(KV_POOL, k[:1], [0]).ok == [True]
    before = path_of(Path(b.root), b, k[0]).read_bytes()
    pool.page_part_view(0, 0).fill_(7)
    res = b.set_from(KV_POOL, k, [0, 1])
    assert res.ok == [True, True] and res.bytes_moved == 2 * PART_BYTES  # only page 1 moved
    assert b.stats().write_skipped_existing == 1
    assert path_of(Path(b.root), b, k[0]).read_bytes() == before


def damage_object(p: Path, damage: str) -> None:
    data = bytearray(p.read_bytes())
    if damage == "flip_payload":
        data[-3] ^= 0x01
    elif damage == "flip_header_name":
        data[40] ^= 0x01  # inside the object name: a foreign object
    elif damage == "truncate":
        data = data[: len(data) - 100]
    else:
        data += b"\0"
    p.write_bytes(bytes(data))


# without verify_checksums the header and size are still checked: only a payload flip goes unseen
@pytest.mark.parametrize(("damage", "verify"), [("flip_payload", True)]
                         + [(d, v) for d in ("flip_header_name", "truncate", "extend")
                            for v in (True, False)])
def test_damaged_objects_are_counted_removed_misses(open_backend, damage, verify):
    pool = make_pool()
    b = open_backend(verify_checksums=verify)
    b.register_pool(KV_POOL, pool)
    ks = keys(3)
    b.set_from(KV_POOL, ks, [0, 1, 2])
    p = path_of(Path(b.root), b, ks[1], PagePart.V)
    damage_object(p, damage)
    res = b.get_into(KV_POOL, ks, [8, 9, 10])
    assert res.ok == [True, False, True]
    assert same(pool, 0, 8) and same(pool, 2, 10)
    assert b.stats().corrupt_objects == 1 and not p.exists()
    assert b.exists(ks).usable_pages == 1


def test_without_verification_a_flipped_payload_byte_is_read_as_is(open_backend, monkeypatch):
    pool = make_pool()
    b = open_backend(verify_checksums=False)
    b.register_pool(KV_POOL, pool)
    assert not b.capabilities.verified
    ks = keys(2)
    b.set_from(KV_POOL, ks, [0, 1])
    p = path_of(Path(b.root), b, ks[1], PagePart.V)
    damage_object(p, "flip_payload")
    monkeypatch.setattr(b, "_checksums", lambda views: pytest.fail("a read hashed its pages"))
    assert b.get_into(KV_POOL, ks, [8, 9]).ok == [True, True]
    assert same(pool, 0, 8) and torch.equal(pool.page_part_view(1, 0), pool.page_part_view(9, 0))
    v_read, v_written = (pool.page_part_view(page, 1).view(torch.uint8) for page in (9, 1))
    assert (v_read != v_written).sum() == 1 and v_read[-3] != v_written[-3]  # the very byte
    assert b.stats().corrupt_objects == 0 and p.exists()
    # the writer stored the checksum all the same: a verifying reader finds the damage
    checker = open_backend()
    checker.register_pool(KV_POOL, pool)
    assert checker.get_into(KV_POOL, ks, [10, 11]).ok == [True, False]
    with pytest.raises(ConfigError, match="verify_checksums.*true or false"):
        NixlOptions(verify_checksums=1)


def test_file_renamed_under_another_key_is_foreign(open_backend):
    pool = make_pool()
    b = open_backend()
    b.register_pool(KV_POOL, pool)
    ks = keys(2)
    b.set_from(KV_POOL, ks[:1], [0])
    for part in PagePart:
        os.link(path_of(Path(b.root), b, ks[0], part), path_of(Path(b.root), b, ks[1], part))
    assert b.get_into(KV_POOL, ks, [5, 6]).ok == [True, False]
    assert b.stats().corrupt_objects >= 1


def test_capacity_evicts_least_recently_used_pages(open_backend):
    pool = make_pool()
    page_file_bytes = 2 * (PART_BYTES + 512)
    b = open_backend(max_size_bytes=3 * page_file_bytes)
    b.register_pool(KV_POOL, pool)
    ks = keys(5)
    b.set_from(KV_POOL, ks[:3], [0, 1, 2])
    assert b.get_into(KV_POOL, ks[:1], [8]).ok == [True]  # page 0 is now the most recent
    b.set_from(KV_POOL, ks[3:5], [3, 4])  # evicts pages 1 and 2
    present = [b.exists([k]).usable_pages for k in ks]
    assert present == [1, 0, 0, 1, 1]
    assert b.stats().evicted_pages == 2
    assert b.stats().stored_bytes <= 3 * page_file_bytes


def test_a_batch_larger_than_capacity_keeps_the_bound(open_backend):
    page_file_bytes = 2 * (PART_BYTES + 512)
    b = open_backend(max_size_bytes=2 * page_file_bytes)
    b.register_pool(KV_POOL, make_pool())
    ks = keys(4)
    # as the file backend: the leading pages that fit are written, the rest refused
    assert b.set_from(KV_POOL, ks, [0, 1, 2, 3]).ok == [True, True, False, False]
    assert b.stats().stored_bytes <= 2 * page_file_bytes
    assert b.exists(ks).usable_pages == 2


def test_page_larger_than_capacity_is_refused(open_backend):
    b = open_backend(max_size_bytes=PART_BYTES)
    b.register_pool(KV_POOL, make_pool())
    assert b.set_from(KV_POOL, keys(1), [0]).ok == [False]


def test_restart_finds_pages_and_their_sizes(open_backend):
    pool = make_pool()
    b = open_backend()
    b.register_pool(KV_POOL, pool)
    ks = keys(3)
    b.set_from(KV_POOL, ks, [0, 1, 2])
    b.close()
    b.close()  # idempotent
    again = open_backend(max_size_bytes=10**9)
    assert again.stats().stored_bytes == 3 * 2 * (PART_BYTES + 512)
    again.register_pool(KV_POOL, pool)
    assert again.get_into(KV_POOL, ks, [5, 6, 7]).ok == [True] * 3
    assert same(pool, 2, 7)


def test_files_are_readable_by_the_file_backend_and_back(open_backend):
    pool = make_pool()
    n, f = open_backend("nixl"), open_backend("file")
    n.register_pool(KV_POOL, pool)
    f.register_pool(KV_POOL, pool)
    ks = keys(4)
    n.set_from(KV_POOL, ks[:2], [0, 1])
    f.set_from(KV_POOL, ks[2:], [2, 3])
    assert f.get_into(KV_POOL, ks, [8, 9, 10, 11]).ok == [True] * 4
    assert n.get_into(KV_POOL, ks, [12, 13, 14, 15]).ok == [True] * 4
    assert all(same(pool, i, 12 + i) for i in range(4))


def test_unusable_root_is_storage_unavailable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    with pytest.raises(StorageUnavailable, match="root_dir"):
        create_backend("nixl", StorageTarget(NS), {"root_dir": str(blocker / "l3")})


def test_ucx_plugin_is_refused_with_advice(root):
    with pytest.raises(StorageUnavailable, match="POSIX"):
        create_backend("nixl", StorageTarget(NS), {"root_dir": str(root), "plugin": "UCX"})


def test_missing_posix_plugin_is_storage_unavailable(monkeypatch, root):
    from nixl._api import nixl_agent
    monkeypatch.setattr(nixl_agent, "get_plugin_list", lambda self: ["UCX"])
    with pytest.raises(StorageUnavailable, match="POSIX plugin"):
        create_backend("nixl", StorageTarget(NS), {"root_dir": str(root)})


def test_names_cannot_escape_root(open_backend):
    b = open_backend()
    b.register_pool(KV_POOL, make_pool())
    from kvtier.backends.file_root import object_path as _object_path
    for bad in ("../" * 8 + "etc/passwd", "/etc/passwd", "a/../../x", "a//b", "a/./b"):
        with pytest.raises(CacheUsageError):
            _object_path(b.root, bad)
    with pytest.raises(CacheUsageError):
        b.set_from(KV_POOL, ["../" + "0" * 61], [0])
    for path in Path(b.root).rglob("*"):
        assert path.resolve().is_relative_to(Path(b.root).resolve())


def test_storage_taken_away_gives_misses_not_errors(open_backend):
    b = open_backend()
    b.register_pool(KV_POOL, make_pool())
    ks = keys(2)
    b.set_from(KV_POOL, ks, [0, 1])
    import shutil
    shutil.rmtree(b.root)
    Path(b.root).write_text("not a directory any more")
    assert b.get_into(KV_POOL, ks, [2, 3]).ok == [False, False]
    assert b.exists(ks).usable_pages == 0
    assert b.set_from(KV_POOL, keys(1, salt=100), [4]).ok == [False]


def test_nixl_error_is_a_failed_batch_and_leaves_no_temp_files(open_backend, monkeypatch):
    b = open_backend()
    b.register_pool(KV_POOL, make_pool())
    monkeypatch.setattr(b.agent, "transfer", lambda *a, **k: False)
    ks = keys(2)
    assert b.set_from(KV_POOL, ks, [0, 1]).ok == [False, False]
    assert [p for p in Path(b.root).rglob("*") if p.is_file()] == []


def test_hung_transfer_disables_the_backend(open_backend, monkeypatch):
    b = open_backend()
    pool = make_pool()
    b.register_pool(KV_POOL, pool)
    ks = keys(1)
    b.set_from(KV_POOL, ks, [0])
    monkeypatch.setattr(b.agent._agent, "check_xfer_state", lambda handle: "PROC")
    monkeypatch.setattr(b.agent._agent, "transfer", lambda handle, notif_msg=b"": "PROC")
    b.timeout_base_s = 0.05
    with pytest.raises(StorageUnavailable, match="did not finish"):
        b.get_into(KV_POOL, ks, [3])
    with pytest.raises(StorageUnavailable, match="disabled"):
        b.exists(ks)


def test_a_later_chunk_that_hangs_disables_the_backend_and_closes_every_file(
        open_backend, monkeypatch, chunked):
    """The second of three read requests never finishes: the helper's work (verifying the
    first chunk, opening the third) is waited for, every file is closed, the backend stops."""
    b = open_backend()
    pool = make_pool()
    b.register_pool(KV_POOL, pool)
    ks = keys(5)
    b.set_from(KV_POOL, ks, [0, 1, 2, 3, 4])
    nixl, posted = b.agent._agent, []
    real_transfer, real_check = nixl.transfer, nixl.check_xfer_state

    def transfer(handle, notif_msg=b""):
        posted.append(handle)
        return real_transfer(handle) if len(posted) == 1 else "PROC"  # never posted: hangs

    monkeypatch.setattr(nixl, "transfer", transfer)
    monkeypatch.setattr(nixl, "check_xfer_state",
                        lambda h: real_check(h) if h is posted[0] else "PROC")
    b.timeout_base_s = 0.05
    before = open_fds()
    with pytest.raises(StorageUnavailable, match="did not finish"):
        b.get_into(KV_POOL, ks, [8, 9, 10, 11, 12])
    assert len(posted) == 2 and open_fds() == before
    with pytest.raises(StorageUnavailable, match="disabled"):
        b.get_into(KV_POOL, ks, [8, 9, 10, 11, 12])


def test_a_transfer_nixl_cannot_release_keeps_its_handle_and_disables_the_backend(
        open_backend, monkeypatch):
    """`transfer` raises and NIXL then refuses to release the handle: the I/O may still run,
    so the handle (and the files it names) stay registered and the backend stops."""
    b = open_backend()
    b.register_pool(KV_POOL, make_pool())

    def refuse(*args, **kwargs):
        raise RuntimeError("NIXL_ERR_BACKEND (injected)")

    monkeypatch.setattr(b.agent._agent, "transfer", refuse)
    monkeypatch.setattr(b.agent._agent, "release_xfer_handle", refuse)
    with pytest.raises(StorageUnavailable, match="could not release"):
        b.set_from(KV_POOL, keys(1), [0])
    assert len(b.agent._stuck) == 2  # the transfer's handle and its files' registration
    with pytest.raises(StorageUnavailable, match="disabled"):
        b.exists(keys(1))


def test_layer_first_pool_is_refused(open_backend):
    b = open_backend()
    with pytest.raises(CacheUsageError, match="page_head"):
        b.register_pool(KV_POOL, HostPool(SPEC, 4, MemLayout.LAYER_FIRST))


@pytest.mark.parametrize("unnamed", [True, False])
def test_both_temp_file_kinds_publish_whole_files_only(open_backend, unnamed):
    pool = make_pool()
    b = open_backend()
    if not unnamed:
        b._temps.close()  # as on a file system without O_TMPFILE: hidden named temp files
    assert b._temps.unnamed is unnamed
    b.register_pool(KV_POOL, pool)
    ks = keys(3)
    assert b.set_from(KV_POOL, ks, [0, 1, 2]).ok == [True] * 3
    files = sorted(p.name for p in Path(b.root).rglob("*") if p.is_file())
    assert len(files) == 6 and not any(name.startswith(".") for name in files)
    assert b.get_into(KV_POOL, ks, [3, 4, 5]).ok == [True] * 3 and same(pool, 1, 4)


def test_bench_measure_runs_small_and_cleans_up(tmp_path):
    from kvtier.bench.storage_nixl import measure
    out = measure(2, str(tmp_path), repeats=1)
    assert set(out) >= {"write_gbps", "read_gbps", "raw_write_gbps", "raw_read_gbps", "write_ratio",
                        "read_ratio", "exists_1000_ms", "page_bytes", "pages"}
    assert out["page_bytes"] == 2 * 737_280 and out["object_bytes"] == 245_760 and out["pages"] == 2
    assert out["layout"] == "page_head"  # one object per KV head and part
    assert all(out[k] > 0 for k in ("write_gbps", "read_gbps", "raw_write_gbps", "raw_read_gbps",
                                    "unverified_write_gbps", "unverified_read_gbps"))
    for side in ("raw", "kvtier_verified", "kvtier_unverified"):  # 12 objects: one request each
        assert out["objects"][side]["write_calls_per_batch"] == 1
        assert out["objects"][side]["read_calls_per_batch"] == 1
    assert list(tmp_path.iterdir()) == []
