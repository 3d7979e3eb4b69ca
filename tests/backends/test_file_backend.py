"""The file backend: on-disk format, never-overwrite, damage, LRU bound, restart, path safety."""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch

from kvtier.backends import file_object
from kvtier.backends.base import KV_POOL, PagePart, StorageTarget, StorageUnavailable
from kvtier.backends.file_backend import FileBackend
from kvtier.backends.file_index import STALE_TMP_S, page_siblings
from kvtier.backends.file_object import HEADER_BYTES, WriteStatus, object_bytes, write_object
from kvtier.backends.registry import create_backend
from kvtier.errors import CacheUsageError, ConfigError
from kvtier.keys import KeyNamespace, page_hashes
from kvtier.kv_spec import HeadRange, KVSpec
from kvtier.policies import MemLayout
from kvtier.storage_options import FileOptions
from kvtier.tiers.host_pool import HostPool

# One KV head per pool: a page is two objects (its head's K and V); TP tests give each rank
# one head of `size`.
SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.bfloat16)
PART = SPEC.page_part_bytes  # 128 bytes
OBJ = object_bytes(PART)
NS = KeyNamespace("org/model", "tenant", "fp1")


def keys(n: int, salt: int = 0) -> list[str]:
    return page_hashes(list(range(salt, salt + 4 * n)), 4)


def make_pool(pages: int = 16, seed: int = 0, layout: MemLayout = MemLayout.PAGE_HEAD) -> HostPool:
    pool = HostPool(SPEC, pages, layout)
    gen = torch.Generator().manual_seed(seed)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(pool.kv.dtype))
    return pool


_OPEN: list[FileBackend] = []


@pytest.fixture(autouse=True)
def _close_backends():
    """Close what a test opened, so no I/O threads outlive it."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def backend(root: Path, rank: int = 0, size: int = 1, io_threads: int = 2, **opts) -> FileBackend:
    target = StorageTarget(NS, HeadRange.of_rank(size * SPEC.num_kv_heads, rank, size))
    b = FileBackend(FileOptions(root_dir=str(root), **opts), target, io_threads)
    _OPEN.append(b)
    return b


def attached(root: Path, pool: HostPool, **kw) -> FileBackend:
    b = backend(root, **kw)
    b.register_pool(KV_POOL, pool)
    return b


def part(pool: HostPool, page: int, p: int) -> torch.Tensor:
    return pool.page_part_view(page, p).clone()


def same_page(pool_a: HostPool, a: int, pool_b: HostPool, b: int) -> bool:
    return all(torch.equal(part(pool_a, a, p), part(pool_b, b, p)) for p in (0, 1))


def obj_path(root: Path, b: FileBackend, key: str, p: int = 0) -> Path:
    return root / b.target.object_name(KV_POOL, key, b.target.heads.start, p)


def stored_on_disk(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*_h*_*"))


def no_tmp_files(root: Path) -> bool:
    return not [f for f in root.rglob(".*") if f.is_file()]


# ---- format and round trip ---------------------------------------------------------------

@pytest.mark.parametrize("layout", [MemLayout.PAGE_HEAD])
@pytest.mark.parametrize("io_threads", [1, 2])
def test_round_trip_is_byte_exact(tmp_path, layout, io_threads):
    src, dst = make_pool(layout=layout), make_pool(seed=1, layout=layout)
    w = attached(tmp_path, src, io_threads=io_threads)
    ks = keys(6)
    res = w.set_from(KV_POOL, ks, [5, 0, 15, 3, 9, 7])
    assert res.ok == [True] * 6 and res.bytes_moved == 6 * 2 * PART
    r = attached(tmp_path, dst, io_threads=io_threads)
    res = r.get_into(KV_POOL, ks, [1, 2, 3, 4, 5, 6])
    assert res.ok == [True] * 6 and res.bytes_moved == 6 * 2 * PART
    assert all(same_page(src, s, dst, d) for s, d in zip([5, 0, 15, 3, 9, 7], [1, 2, 3, 4, 5, 6]))
    assert no_tmp_files(tmp_path)


def test_one_file_per_part_with_header_and_private_dirs(tmp_path):
    pool = make_pool()
    b = attached(tmp_path, pool, fsync=True)
    k = keys(1)[0]
    b.set_from(KV_POOL, [k], [2])
    for p in (PagePart.K, PagePart.V):
        name = b.target.object_name(KV_POOL, k, 0, p)
        assert name.endswith(f"{k}_h0_{p.suffix}")
        data = (tmp_path / name).read_bytes()
        assert len(data) == HEADER_BYTES + PART == OBJ
        assert data[:8] == file_object.MAGIC and name.encode() in data[:HEADER_BYTES]
        assert data[HEADER_BYTES:] == pool.page_part_view(2, p).numpy().tobytes()
    ns_dir = tmp_path / NS.name
    for d in (ns_dir, ns_dir / KV_POOL):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert b.names(b.pools[KV_POOL], k) == [b.target.object_name(KV_POOL, k, 0, p) for p in (0, 1)]
    assert b.capabilities.zero_copy and b.capabilities.shared and b.capabilities.persistent
    assert b.capabilities.verified and b.capabilities.bounded


class ScatteredPool:
    """A pool whose page parts are separate allocations: no single region, no fixed stride."""

    def __init__(self, pages: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.num_pages = pages
        self.parts = [[torch.randint(0, 256, (PART,), dtype=torch.uint8, generator=gen)
                       for _ in (0, 1)] for _ in range(pages)]

    def page_head_view(self, page: int, head: int, part: int) -> torch.Tensor:
        return self.parts[page][part]

    def data_ptr(self) -> int:
        return self.parts[0][0].data_ptr()

    @property
    def nbytes(self) -> int:
        return PART


def test_page_views_are_the_pools_own_memory(tmp_path):
    pool = make_pool(pages=7)
    b = attached(tmp_path, pool)
    pf = b._files[KV_POOL]
    assert pf.rows[0] is not None and pf.rows[1] is not None  # the fast path is taken
    for page in range(7):
        for p in (0, 1):
            mv = pf.view(page, p)
            assert mv.nbytes == PART
            assert mv.obj.ctypes.data == pool.page_part_view(page, p).data_ptr()
    with pytest.raises(Exception, match="outside the host pool"):
        pf.view(7, 0)  # out of range: the pool's own error, never a wrapped-around row
    scattered, copy = ScatteredPool(4, seed=1), ScatteredPool(4, seed=2)
    w = backend(tmp_path / "s")
    w.register_pool(KV_POOL, scattered)
    assert w._files[KV_POOL].rows == [None, None]  # falls back to page_head_view per access
    assert w.set_from(KV_POOL, keys(4), [0, 1, 2, 3]).ok == [True] * 4
    assert w.get_into(KV_POOL, keys(4)[::-1], [0, 1, 2, 3]).ok == [True] * 4
    w2 = backend(tmp_path / "s")
    w2.register_pool(KV_POOL, copy)
    assert w2.get_into(KV_POOL, keys(4), [0, 1, 2, 3]).ok == [True] * 4
    assert all(torch.equal(copy.parts[i][p], scattered.parts[3 - i][p])
               for i in range(4) for p in (0, 1))


def test_registry_builds_the_file_backend(tmp_path):
    b = create_backend("file", StorageTarget(NS), {"root_dir": str(tmp_path)})
    assert isinstance(b, FileBackend)
    b.close()
    b.close()  # idempotent
    b._close()


def test_exists_only_stats(tmp_path, monkeypatch):
    b = attached(tmp_path, make_pool())
    ks = keys(3)
    b.set_from(KV_POOL, ks[:2], [0, 1])
    monkeypatch.setattr(file_object.os, "open", lambda *a, **k: pytest.fail("exists opened a file"))
    assert b.exists(ks).usable_pages == 2


# ---- never overwrite -----------------------------------------------------------------------

def test_existing_object_is_never_overwritten(tmp_path):
    pool = make_pool()
    b = attached(tmp_path, pool)
    k = keys(1)
    original = part(pool, 0, 0)
    b.set_from(KV_POOL, k, [0])
    before = obj_path(tmp_path, b, k[0]).stat()
    pool.page_part_view(0, 0).fill_(7)
    res = b.set_from(KV_POOL, k, [0])
    assert res.ok == [True] and res.bytes_moved == 0
    assert b.stats().write_skipped_existing == 1
    after = obj_path(tmp_path, b, k[0]).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert b.get_into(KV_POOL, k, [4]).ok == [True]
    assert torch.equal(part(pool, 4, 0), original)


def test_a_racing_writer_keeps_the_first_object(tmp_path):
    path = str(tmp_path / "obj")
    first = memoryview(bytearray(b"a" * 100))
    assert write_object(path, b"obj", first, fsync=False).status is WriteStatus.WRITTEN
    second = memoryview(bytearray(b"b" * 100))
    assert write_object(path, b"obj", second, fsync=False).status is WriteStatus.EXISTED
    assert Path(path).read_bytes()[HEADER_BYTES:] == b"a" * 100
    assert os.listdir(tmp_path) == ["obj"]  # no temp file left behind


def test_missing_part_is_written_alone(tmp_path):
    pool = make_pool()
    b = attached(tmp_path, pool)
    k = keys(1)
    b.set_from(KV_POOL, k, [1])
    os.unlink(obj_path(tmp_path, b, k[0], 1))
    assert b.exists(k).usable_pages == 0
    res = b.set_from(KV_POOL, k, [1])
    assert res.ok == [True] and res.bytes_moved == PART
    assert b.get_into(KV_POOL, k, [9]).ok == [True] and same_page(pool, 1, pool, 9)


def _writer(root: str, order: list[int], seed: int) -> None:
    """A separate process writing pages one at a time (multiprocessing target)."""
    pool = make_pool(pages=40, seed=seed)
    b = attached(Path(root), pool)
    ks = keys(40)
    for i in order:
        assert b.set_from(KV_POOL, [ks[i]], [i]).ok == [True]
    b.close()


def test_concurrent_writer_processes_leave_every_object_intact(tmp_path):
    ctx = multiprocessing.get_context("spawn")  # no fork after torch started threads
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), list(range(0, 30)), 3)),
             ctx.Process(target=_writer, args=(str(tmp_path), list(reversed(range(10, 40))), 3))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    expected, got = make_pool(pages=40, seed=3), make_pool(pages=40, seed=4)
    r = attached(tmp_path, got)
    res = r.get_into(KV_POOL, keys(40), list(range(40)))
    assert res.ok == [True] * 40
    assert all(same_page(expected, i, got, i) for i in range(40))
    assert r.stats().corrupt_objects == 0 and no_tmp_files(tmp_path)


# ---- damage: a miss, the object removed, the counter raised ----------------------------------

def _flip_payload(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 3] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path, other: Path) -> None:
    os.truncate(path, HEADER_BYTES + PART // 2)


def _truncate_header(path: Path, other: Path) -> None:
    os.truncate(path, 10)


def _append(path: Path, other: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"x")


def _change_header_key(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(path.name.encode())
    data[at] = ord("f") if data[at] != ord("f") else ord("e")  # another (valid) hash
    path.write_bytes(bytes(data))


def _rename_other_page(path: Path, other: Path) -> None:
    os.unlink(path)
    os.rename(other, path)  # a good object of another page, under this page's name


def _bad_magic(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


_HEADER_DAMAGE = [_truncate, _truncate_header, _append, _change_header_key, _rename_other_page,
                  _bad_magic]


# without verify_checksums the header is still checked: only a payload flip goes unseen
@pytest.mark.parametrize(("damage", "verify"), [(_flip_payload, True)]
                         + [(d, v) for d in _HEADER_DAMAGE for v in (True, False)])
def test_damaged_object_is_a_miss_and_removed(tmp_path, damage, verify, caplog):
    pool = make_pool()
    b = attached(tmp_path, pool, verify_checksums=verify)
    ks = keys(4)
    b.set_from(KV_POOL, ks, [0, 1, 2, 3])
    victim, other = obj_path(tmp_path, b, ks[1], 1), obj_path(tmp_path, b, ks[3], 1)
    damage(victim, other)
    with caplog.at_level(logging.WARNING, logger="kvtier.backends.file_backend"):
        res = b.get_into(KV_POOL, ks[:3], [8, 9, 10])
    assert res.ok == [True, False, True] and res.leading_ok == 1
    assert same_page(pool, 0, pool, 8) and same_page(pool, 2, pool, 10)
    assert b.stats().corrupt_objects == 1 and b.stats().read_misses == 1
    assert not victim.exists() and "removed bad object" in caplog.text
    assert b.exists(ks[:3]).usable_pages == 1
    if damage is not _rename_other_page:  # a rename behind its back is not seen by the index
        assert b.stats().stored_bytes == stored_on_disk(tmp_path)


def test_without_verification_a_flipped_payload_byte_is_read_as_is(tmp_path):
    pool = make_pool()
    b = attached(tmp_path, pool, verify_checksums=False)
    assert not b.capabilities.verified
    ks = keys(2)
    b.set_from(KV_POOL, ks, [0, 1])
    victim = obj_path(tmp_path, b, ks[1], 1)
    _flip_payload(victim, victim)
    assert b.get_into(KV_POOL, ks, [8, 9]).ok == [True, True]
    assert same_page(pool, 0, pool, 8) and torch.equal(part(pool, 1, 0), part(pool, 9, 0))
    flipped = part(pool, 9, 1).view(torch.uint8) != part(pool, 1, 1).view(torch.uint8)
    assert flipped.sum() == 1 and flipped[3]  # the very byte, not a miss
    assert b.stats().corrupt_objects == 0 and victim.exists()
    # the writer stored the checksum all the same: a verifying reader finds the damage
    assert attached(tmp_path, pool).get_into(KV_POOL, ks, [10, 11]).ok == [True, False]
    with pytest.raises(ConfigError, match="verify_checksums.*true or false"):
        FileOptions(root_dir=str(tmp_path), verify_checksums="no")


def test_symlink_under_an_object_name_is_never_followed(tmp_path):
    pool = make_pool()
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    b = attached(tmp_path / "root", pool)
    k = keys(1)
    b.set_from(KV_POOL, k, [0])
    victim = obj_path(tmp_path / "root", b, k[0], 0)
    os.unlink(victim)
    os.symlink(outside, victim)
    assert b.exists(k).usable_pages == 0
    assert b.get_into(KV_POOL, k, [1]).ok == [False]
    assert not victim.is_symlink() and outside.read_bytes() == b"secret"


def test_missing_object_is_a_plain_miss(tmp_path):
    b = attached(tmp_path, make_pool())
    ks = keys(2)
    b.set_from(KV_POOL, ks[:1], [0])
    assert b.get_into(KV_POOL, ks, [4, 5]).ok == [True, False]
    assert b.stats().corrupt_objects == 0 and b.stats().read_misses == 1


# ---- capacity, delete, restart -----------------------------------------------------------------

def test_lru_eviction_keeps_recently_read_pages(tmp_path):
    pool = make_pool()
    b = attached(tmp_path, pool, max_size_bytes=4 * 2 * OBJ)
    ks = keys(6)
    b.set_from(KV_POOL, ks[:4], [0, 1, 2, 3])
    assert b.stats().stored_bytes == 4 * 2 * OBJ
    assert b.get_into(KV_POOL, ks[:1], [8]).ok == [True]  # page 0 is now the most recent
    b.set_from(KV_POOL, ks[4:5], [4])
    assert b.stats().evicted_pages == 1
    assert [b.exists([k]).usable_pages for k in ks[:5]] == [1, 0, 1, 1, 1]
    assert not any(obj_path(tmp_path, b, ks[1], p).exists() for p in (0, 1))
    b.set_from(KV_POOL, ks[5:6], [5])
    assert [b.exists([k]).usable_pages for k in ks] == [1, 0, 0, 1, 1, 1]
    assert b.stats().stored_bytes == 4 * 2 * OBJ == stored_on_disk(tmp_path)


def test_a_batch_larger_than_the_bound_stores_its_leading_pages(tmp_path):
    b = attached(tmp_path, make_pool(), max_size_bytes=3 * 2 * OBJ)
    ks = keys(5)
    assert b.set_from(KV_POOL, ks, [0, 1, 2, 3, 4]).ok == [True, True, True, False, False]
    assert b.exists(ks).usable_pages == 3 and b.stats().write_failures == 2
    tiny = attached(tmp_path / "tiny", make_pool(), max_size_bytes=OBJ)
    assert tiny.set_from(KV_POOL, ks[:1], [0]).ok == [False]


def test_eviction_removes_every_rank_of_the_page(tmp_path):
    pool = make_pool()
    r0, r1 = attached(tmp_path, pool, size=2), attached(tmp_path, pool, rank=1, size=2)
    ks = keys(3)
    r1.set_from(KV_POOL, ks[:1], [0])
    r0.set_from(KV_POOL, ks[:1], [0])
    assert page_siblings(r0.target.object_name(KV_POOL, ks[0], 0, 0), 2) == [
        r.target.object_name(KV_POOL, ks[0], r.target.heads.start, p)
        for r in (r0, r1) for p in (0, 1)]
    small = attached(tmp_path, pool, size=2, max_size_bytes=4 * OBJ)  # finds both ranks' parts
    assert small.stats().stored_bytes == 4 * OBJ
    small.set_from(KV_POOL, ks[1:2], [1])
    assert r1.exists(ks[:1]).usable_pages == 0 and r0.exists(ks[:1]).usable_pages == 0
    assert small.stats().evicted_pages == 1 and small.stats().stored_bytes == 2 * OBJ


def test_delete_removes_objects_and_bytes(tmp_path):
    b = attached(tmp_path, make_pool())
    ks = keys(3)
    b.set_from(KV_POOL, ks, [0, 1, 2])
    assert b.delete(ks[:2]) == 2 and b.delete(ks[:2]) == 0
    assert b.stats().stored_bytes == 2 * OBJ and b.exists(ks[2:]).usable_pages == 1
    assert not obj_path(tmp_path, b, ks[0]).exists()


def test_restart_finds_objects_and_their_order(tmp_path):
    pool = make_pool()
    b = attached(tmp_path, pool)
    ks = keys(4)
    b.set_from(KV_POOL, ks, [0, 1, 2, 3])
    b.close()
    now = time.time()
    for age, k in zip([10, 40, 30, 20], ks):  # page 1 is the oldest, then 2
        for p in (0, 1):
            os.utime(obj_path(tmp_path, b, k, p), (now - age, now - age))
    again = attached(tmp_path, make_pool(seed=5))
    assert again.stats().stored_bytes == 4 * 2 * OBJ and again.stats().extra["scan_objects"] == 8
    assert again.exists(ks).usable_pages == 4
    bounded = attached(tmp_path, make_pool(seed=5), max_size_bytes=2 * 2 * OBJ)  # evicts at attach
    assert bounded.stats().evicted_pages == 2
    assert [again.exists([k]).usable_pages for k in ks] == [1, 0, 0, 1]
    assert again.get_into(KV_POOL, [ks[0], ks[3]], [8, 9]).ok == [True, True]
    assert again.pools[KV_POOL].pool.page_part_view(8, 0).equal(pool.page_part_view(0, 0))


def test_stale_temp_files_are_removed_at_attach(tmp_path):
    b = attached(tmp_path, make_pool())
    b.set_from(KV_POOL, keys(1), [0])
    pool_dir = obj_path(tmp_path, b, keys(1)[0]).parent
    stale, fresh = pool_dir / ".x.1.aa.tmp", pool_dir / ".y.2.bb.tmp"
    stale.write_bytes(b"torn")
    fresh.write_bytes(b"being written")
    old = time.time() - STALE_TMP_S - 60
    os.utime(stale, (old, old))
    again = attached(tmp_path, make_pool())
    assert not stale.exists() and fresh.exists()  # a live writer's file is left alone
    assert again.stats().stored_bytes == 2 * OBJ


def test_directory_removed_under_a_writer_is_recreated(tmp_path):
    b = attached(tmp_path, make_pool())
    ks = keys(2)
    b.set_from(KV_POOL, ks[:1], [0])
    shutil.rmtree(tmp_path / NS.name)
    assert b.set_from(KV_POOL, ks[1:], [1]).ok == [True]
    assert b.exists(ks[1:]).usable_pages == 1


# ---- attach and path safety --------------------------------------------------------------------

def test_root_blocked_by_a_file_is_unavailable_at_attach(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("in the way")
    for root in (blocker, blocker / "below"):
        with pytest.raises(StorageUnavailable, match="root_dir"):
            backend(root)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_root_is_unavailable_at_attach(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(StorageUnavailable, match="writable"):
            backend(root)
    finally:
        root.chmod(0o700)


def test_permission_denied_is_unavailable_at_attach(tmp_path, monkeypatch):
    from kvtier.backends import file_root

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(file_root.tempfile, "mkstemp", denied)  # what a 0500 root gives non-root
    with pytest.raises(StorageUnavailable, match="Permission denied.*writable directory"):
        backend(tmp_path)


def test_names_cannot_leave_the_root(tmp_path):
    b = attached(tmp_path / "root", make_pool())
    for bad in ("../x", "/etc/passwd", "a/../../x", "a//b", "./a"):
        with pytest.raises(CacheUsageError):
            b.root.object_path(bad)
    with pytest.raises(CacheUsageError):
        b.exists(["../../etc/passwd"])


def test_symlinked_namespace_dir_is_not_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / NS.name)
    b = attached(root, make_pool())
    ks = keys(1)
    assert b.set_from(KV_POOL, ks, [0]).ok == [False]
    assert b.exists(ks).usable_pages == 0 and b.get_into(KV_POOL, ks, [1]).ok == [False]
    assert not any(outside.rglob("*"))


def test_bench_measure_reports_every_field(tmp_path):
    from kvtier.bench.storage_file import measure
    out = measure(2, str(tmp_path / "bench"), repeats=1)
    assert set(out) == {"write_gbps", "read_gbps", "raw_write_gbps", "raw_read_gbps", "write_ratio",
                        "read_ratio", "unverified_write_gbps", "unverified_read_gbps",
                        "unverified_write_ratio", "unverified_read_ratio", "objects",
                        "exists_1000_ms", "page_bytes", "pages", "layout", "objects_per_page"}
    assert out["page_bytes"] == 2 * 737_280 and out["pages"] == 2
    assert out["layout"] == "page_head" and out["objects_per_page"] == 6  # 3 heads x K, V
    assert all(out[k] > 0 for k in out if k not in ("layout", "objects"))
    assert set(out["objects"]) == {"raw", "kvtier_verified", "kvtier_unverified"}
    assert not any((tmp_path / "bench").iterdir())  # cleans up after itself
