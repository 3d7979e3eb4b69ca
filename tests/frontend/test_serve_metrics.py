"""/metrics after real traffic on the served graph: one instance of the tiny model at TP=2 over
a file L3, prompts that hit L1, then L2 (loaded back), then L3 (prefetched).

Every family then has a nonzero sample, except the ones only a fault or an overload moves
(FAULT_FAMILIES) and the ones the faults of other tests move (ELSEWHERE). The second test makes the faults for real (a corrupt L3
object, the L3 pool directory replaced by a file, the namespace actor and a rank killed) and
sees each of FAULT_FAMILIES move.

Why these settings: TP=2, since agreement rounds (kvtier_agreement_seconds) run only between
ranks; one instance, so every prompt meets the same cache; 24 L1 pages and 48 L2 pages of 16
tokens, so a few 160-token prompts push a 96-token prefix out of L1 and others out of L2; an
L3 prefetch threshold of two pages (the default, 256 tokens, is more than these prompts
have), so a 96-token L3 hit is fetched and a one-page tail is below the threshold; an L3
bound of 48 pages (l3_max_gb), which the prompts before the L3 hit stay under and the bursts
after it pass, so the namespace evicts.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from eventually import eventually
from http_client import ServeClient
from prometheus_client.parser import text_string_to_metric_families
from shared_serve import BASE, served
from test_metrics import dashboard_series

from kvtier.engine.weight_sources import TinyWeights
from kvtier.frontend.metrics import (COUNTERS, GAUGES, HISTOGRAMS, NAMESPACE_COUNTERS,
                                     NAMESPACE_GAUGES, PREFIX, TIER_GAUGES)
from kvtier.frontend.settings import ServeSettings

KEY = "test-admin-key-metrics-0123456789"
PAGE = 16
_TINY = TinyWeights().config()
PAGE_BYTES = 2 * _TINY.num_layers * _TINY.num_kv_heads * _TINY.head_dim * PAGE * 4  # K, V; fp32
SETTINGS = ServeSettings(model="tiny", instances=1, tp_size=2, page_size=PAGE,
                         chunk_tokens=4 * PAGE, device_pages=24, hicache_ratio=2.0,
                         max_new_tokens=32, dtype="fp32", admin_key=KEY,
                         hicache={"prefetch_threshold_tokens": 2 * PAGE,
                                  "load_back_threshold_tokens": 2 * PAGE},
                         l3_max_gb=48 * PAGE_BYTES / 2**30)
MODEL = SETTINGS.served_model_name
CLIENT = ServeClient(BASE, MODEL, KEY)
SNAPSHOT_WAIT_S = 30.0  # the ingress folds instance snapshots in every 2 s
BURSTS = 3  # concurrent bursts at most, until the queue gauges were seen above 0

# Families that only faults or overload move, each with the fault that moves it here.
FAULT_FAMILIES = {
    "storage_corrupt_objects": "an L3 object that fails its check on read",
    "storage_errors": "an L3 write that fails (lookups go through the directory here)",
    "dropped_backup_tokens": "an L3 write that fails (or an L2 with no page to spare)",
    "directory_errors": "the namespace actor killed (restarting)",
    "l3_directory_misses": "the namespace actor killed (restarting)",
    "rank_restarts": "a rank process killed",
}
ELSEWHERE = {  # faults other tests make
    "rank_divergences": "tests/actors/test_rank_agreement.py",
    "instance_stalls": "tests/frontend/test_serve_stall.py",
    "redispatched_requests": "tests/frontend/test_serve_stall.py",
    "instance_stalled": "tests/frontend/test_serve_stall.py",
    "pins": "tests/frontend/test_serve_pins.py",
    "pinned_pages": "tests/frontend/test_serve_pins.py",
    "l3_pins": "tests/frontend/test_serve_pins.py",
    "l3_pinned_pages": "tests/frontend/test_serve_pins.py",
    "l3_old_format_pages_reclaimed": "tests/tiers/test_old_format_and_purge.py (old objects)",
    "l3_purged_pages": "tests/frontend/test_serve_app.py (POST /admin/purge)",
}
ALL = {*COUNTERS, *GAUGES, *HISTOGRAMS, *NAMESPACE_COUNTERS, *NAMESPACE_GAUGES, *TIER_GAUGES}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    l3 = tmp_path_factory.mktemp("l3")
    with served(dataclasses.replace(SETTINGS, l3_root=str(l3))) as pids:
        yield l3, pids


_rng = random.Random(7)


def ids(n: int) -> list[int]:
    """`n` fresh token ids (the tiny model's vocabulary): a prompt no cache holds yet."""
    return [_rng.randrange(1, 250) for _ in range(n)]


def complete(prompt: list[int], max_tokens: int = 4) -> dict:
    return CLIENT.complete(prompt, max_tokens)


def families() -> list:
    text = CLIENT.metrics()
    # the parser gives counters' start times (`_created`) families of their own
    return [f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")]


def samples() -> dict[str, float]:
    """Family (without the prefix) -> its largest sample (histograms: count and sum)."""
    out: dict[str, float] = {}
    for fam in families():
        values = [s.value for s in fam.samples if not s.name.endswith(("_created", "_bucket"))]
        out[fam.name.removeprefix(PREFIX)] = max(values, default=0.0)
    return out


def tier_samples(family: str) -> dict[str, float]:
    fam = next(f for f in families() if f.name == PREFIX + family)
    return {s.labels["tier"]: s.value for s in fam.samples if s.name.endswith("_total")}


def wait_moved(names: set[str], before: dict[str, float] | None = None) -> None:
    """Until each family of `names` has a sample above its value in `before` (default 0),
    bounded."""
    before = before or {}

    def moved() -> bool:
        now = samples()
        still = sorted(f for f in names if now.get(f, 0) <= before.get(f, 0))
        assert not still, f"not moved: {still}"
        return True

    eventually(moved, SNAPSHOT_WAIT_S, "the metric families moved", retry_on=(AssertionError,),
               interval_s=0.5)


def burst_until_queued() -> set[str]:
    """Concurrent requests, /metrics read meanwhile, until the running and waiting gauges
    showed work (at most BURSTS bursts); the gauges seen above 0."""
    seen: set[str] = set()
    for _ in range(BURSTS):
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.update(f for f in ("running_requests", "waiting_requests")
                            if samples().get(f, 0) > 0)
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                list(pool.map(lambda _: complete(ids(2 * PAGE + 8), 32), range(12)))
        finally:
            done.set()
            watcher.join(30)
        if {"running_requests", "waiting_requests"} <= seen:
            break
    return seen


def test_after_traffic_every_family_has_moved_but_the_fault_ones(app) -> None:
    shared = ids(6 * PAGE)  # a 96-token prefix
    complete(shared + ids(8))
    again = complete(shared + ids(8))
    assert again["kvtier"]["cached_tokens"]["device"] == 6 * PAGE  # L1
    for _ in range(3):  # 30 pages more: the prefix leaves L1, stays in L2
        complete(ids(10 * PAGE))
    again = complete(shared + ids(8))
    assert again["kvtier"]["cached_tokens"]["host"] == 6 * PAGE  # L2, loaded back
    CLIENT.flush()  # L1 and L2 dropped: the prefix is in L3 only
    again = complete(shared + ids(8))
    assert again["kvtier"]["cached_tokens"]["storage"] > 0  # L3, prefetched (in time)
    complete(ids(PAGE + 4))  # a one-page tail: below the prefetch threshold
    other = ids(2 * PAGE)
    complete(other + ids(8))
    for _ in range(3):  # it leaves L1, stays in L2
        complete(ids(10 * PAGE))
    complete(other[:PAGE] + ids(8))  # a one-page L2 hit: below the load-back threshold
    seen = burst_until_queued()

    wait_moved(ALL - set(FAULT_FAMILIES) - set(ELSEWHERE) - seen)
    assert samples()["l3_capacity_pages"] == 48
    for family in ("cached_tokens", "hit_tokens"):  # peers are off here (test_serve_peers)
        moved = {t: v for t, v in tier_samples(family).items() if t != "peer"}
        assert moved and all(v > 0 for v in moved.values()), tier_samples(family)
    present = set(samples())
    assert present == ALL, sorted(present ^ ALL)  # every family is on the page
    # and the dashboard graphs series the page has
    rendered = {s.name for f in families() for s in f.samples}
    assert dashboard_series() <= rendered, sorted(dashboard_series() - rendered)


def l3_objects(l3: Path) -> list[Path]:
    """The page objects under the L3 root (not the namespace actor's state or markers)."""
    return [p for p in l3.rglob("*_[kv]") if p.is_file() and not p.name.startswith(".")]


def wait_objects(l3: Path, at_least: int, old: set[Path]) -> list[Path]:
    """Until `at_least` objects not in `old` are written (the namespace's bound evicts old
    ones meanwhile, least recently used first); those new ones."""

    def written() -> list[Path]:
        found = [p for p in l3_objects(l3) if p not in old]
        assert len(found) >= at_least, f"{len(found)} new L3 objects"
        return found

    return eventually(written, SNAPSHOT_WAIT_S, f"{at_least} new L3 objects were written",
                      retry_on=(AssertionError,), interval_s=0.2)


def until_moved(family: str, make_traffic, attempts: int = 10) -> None:
    """`make_traffic()` until `family` grew past its value now (at most `attempts` times,
    then the snapshot wait)."""
    before = samples()
    for _ in range(attempts):
        make_traffic()
        time.sleep(0.3)
        if samples().get(family, 0) > before.get(family, 0):
            return
    wait_moved({family}, before)


def corrupt(path: Path) -> None:
    """Flip the last bytes of an object's payload (its checksum no longer matches)."""
    with path.open("r+b") as f:
        f.seek(-8, os.SEEK_END)
        tail = f.read(8)
        f.seek(-8, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))


def replace_with_file(directory: Path) -> None:
    """Put a plain file where `directory` is (a write may make the directory again between
    the two steps: then again, a few times at most)."""
    moved = directory.with_name(directory.name + ".moved")
    for _ in range(5):
        shutil.rmtree(moved, ignore_errors=True)
        directory.rename(moved)
        try:
            os.close(os.open(directory, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        shutil.rmtree(moved)
        return
    pytest.fail(f"{directory} kept coming back as a directory")


def test_the_fault_families_move_under_real_faults(app) -> None:
    l3, pids = app
    healthy = samples()
    assert not any(healthy.get(f, 0) for f in FAULT_FAMILIES), healthy

    # L3 objects changed on disk: a read fails their check and removes them.
    prompt = ids(6 * PAGE + 4)
    before = set(l3_objects(l3))
    complete(prompt)
    objects = wait_objects(l3, 6 * SETTINGS.tp_size * 2, before)  # 6 pages, k and v
    for path in objects:
        corrupt(path)

    def ask_l3_again() -> None:
        CLIENT.flush()
        complete(prompt)

    until_moved("storage_corrupt_objects", ask_l3_again)

    # The pool directory replaced by a file: L3 writes fail, their backups are dropped.
    before = samples()
    pool_dir = objects[0].parent
    replace_with_file(pool_dir)
    try:
        complete(ids(5 * PAGE + 4))
        wait_moved({"storage_errors", "dropped_backup_tokens"}, before)
    finally:
        if pool_dir.is_file():
            pool_dir.unlink()
        pool_dir.mkdir(exist_ok=True)

    # The namespace actor killed: Ray restarts it; meanwhile directory calls fail.
    import ray

    from kvtier.actors.l3.namespace_actor import RAY_NAMESPACE

    ray.kill(ray.get_actor(SETTINGS.l3_actor, namespace=RAY_NAMESPACE), no_restart=False)
    until_moved("directory_errors", lambda: complete(ids(3 * PAGE + 4)))
    until_moved("l3_directory_misses", lambda: complete(ids(3 * PAGE + 4)))

    # A rank process killed: the instance replaces its ranks and answers.
    ranks = [pid for pid in pids if b"Rank" in cmdline(pid)]
    assert len(ranks) == SETTINGS.tp_size, ranks
    os.kill(ranks[0], signal.SIGKILL)

    def ask_while_it_recovers() -> None:
        # Until Ray reports the rank dead the instance takes no step: past the stall
        # timeout (2 s) the router holds it stalled, and with no other instance the client
        # is told to retry (a 503, no_instance_available), as docs/serving.md says
        r = CLIENT.post("/v1/completions", {"model": MODEL, "prompt": ids(2 * PAGE),
                                            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 or (
            r.status_code == 503 and r.json()["error"]["code"] == "no_instance_available"
        ), r.text
    until_moved("rank_restarts", ask_while_it_recovers)
    complete(ids(2 * PAGE))  # and once its ranks are back, it answers


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
