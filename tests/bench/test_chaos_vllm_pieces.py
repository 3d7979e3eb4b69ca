"""The pieces of `kvtier bench chaos --engine vllm` that need no cluster: the fault kinds and
their places in a round, the command line, outages against the recovery bound, the probes
counted and judged, the audit and the result, and the file L3's faults on a directory."""
from __future__ import annotations

import json
import os
import random
import time

import pytest

import kvtier.cli.main as cli
from kvtier.actors.chaos_engines import Probe
from kvtier.backends.file_object import HEADER_BYTES
from kvtier.bench import chaos, chaos_l3, chaos_monitor
from kvtier.bench.chaos_clients import AnswerKind, Tally
from kvtier.bench.chaos_vllm import EngineAudits, ProbeRecord, record_probes
from kvtier.engine.request import CachedTokens
from kvtier.errors import ConfigError
from kvtier.frontend.settings import EngineKind
from kvtier.policies import StorageBackendKind, Transport

F = chaos.Fault
FILE, VLLM, NIXL = StorageBackendKind.FILE, EngineKind.VLLM, Transport.NIXL
STORAGE = {F.STOP_HOLDER, F.CORRUPT_L3, F.L3_FULL, F.LATE_RANK_FETCH}


def test_the_vllm_faults_follow_the_l3_and_the_peers():
    assert chaos.fault_kinds(FILE, False, VLLM) == [F.KILL_ENGINE, F.KILL_NAMESPACE,
                                                    F.NAMESPACE_STATE_LOST, F.CORRUPT_L3,
                                                    F.L3_FULL, F.LATE_RANK_FETCH]
    assert chaos.fault_kinds(None, False, VLLM, NIXL) == [F.KILL_ENGINE, F.STOP_HOLDER,
                                                          F.KILL_NAMESPACE,
                                                          F.NAMESPACE_STATE_LOST]
    assert set(chaos.fault_kinds(FILE, False, VLLM, NIXL)) == set(chaos.VLLM_FAULTS) | {
        F.KILL_NAMESPACE, F.NAMESPACE_STATE_LOST}
    assert chaos.fault_kinds(None, False, VLLM) == [F.KILL_ENGINE]  # no namespace actor


def test_each_round_sends_documents_first_and_kills_an_engine_last():
    kinds = chaos.fault_kinds(FILE, False, VLLM, NIXL)
    injector = chaos.Injector.__new__(chaos.Injector)
    injector.kinds, injector.rng = kinds, random.Random(5)
    plan = injector.plan(3 * len(kinds))
    for start in range(0, len(plan), len(kinds)):
        round_ = plan[start:start + len(kinds)]
        assert set(round_[:4]) == STORAGE and round_[-1] is F.KILL_ENGINE
        assert set(round_[4:6]) == {F.KILL_NAMESPACE, F.NAMESPACE_STATE_LOST}
    assert plan[:4] != plan[len(kinds):len(kinds) + 4] or plan[4:6] != plan[11:13]  # shuffled


def parse(*args: str) -> chaos.ChaosParams:
    return chaos.params_of(cli.build_parser().parse_args(["bench", "chaos", *args]))


def test_the_command_line_of_the_vllm_run():
    p = parse("--engine", "vllm")
    assert (p.engine, p.l3, p.peers, p.recover_within_s) == (VLLM, FILE, None, 300.0)
    p = parse("--engine", "vllm", "--peer-transport", "nixl", "--recover-within", "120")
    assert (p.l3, p.peers, p.recover_within_s) == (None, NIXL, 120.0)  # peers only
    assert parse("--engine", "vllm", "--peer-transport", "nixl", "--l3", "file").l3 is FILE
    assert parse().l3 is FILE and parse().engine is EngineKind.KVTIER
    for bad, needle in ((["--engine", "vllm", "--l3", "mooncake"], "--l3 mooncake"),
                        (["--l3", "none"], "--l3 none"),
                        (["--peer-transport", "nixl"], "--peer-transport"),
                        (["--engine", "vllm", "--pd"], "--pd"),
                        (["--engine", "vllm", "--recover-within", "1"], "--recover-within")):
        with pytest.raises(ConfigError, match=needle):
            parse(*bad)


# ---- outages ---------------------------------------------------------------------------------
class Graph:
    """What the monitor looks at: the router's instances and Serve's states, set by a test."""

    def __init__(self) -> None:
        self.router = {"instance-0": {"epoch": 0}, "instance-1": {"epoch": 0}}
        self.serve = {"instance-0": "HEALTHY", "instance-1": "HEALTHY"}

    def monitor(self, monkeypatch, bound: float | None) -> chaos_monitor.Monitor:
        monkeypatch.setattr(chaos_monitor, "router_status",
                            lambda base, key: {"instances": self.router} if self.router else {})
        return chaos_monitor.Monitor("http://x", "k", lambda: dict(self.serve), bound)


def test_an_outage_that_ends_within_the_bound_is_a_recovery(monkeypatch):
    graph = Graph()
    monitor = graph.monitor(monkeypatch, bound=60.0)
    graph.router["instance-0"] = {"epoch": 0, "broken": "EngineDeadError"}
    monitor.look()
    assert not monitor.all_up
    graph.router["instance-0"] = {"epoch": 0}
    graph.serve["instance-0"] = "UNHEALTHY (HEALTH_CHECK_FAILED): replacing it"
    monitor.look()
    graph.router = {}  # the router does not answer: nothing learned
    graph.serve["instance-0"] = "HEALTHY"
    monitor.look()
    assert not monitor.all_up and not monitor.lost
    graph.router = {"instance-0": {"epoch": 0}, "instance-1": {"epoch": 0, "state": "live"}}
    monitor.look()
    assert monitor.all_up and not monitor.lost
    (recovery,) = monitor.recoveries["instance-0"]
    assert recovery["why"].startswith("the router holds it broken") and recovery["down_s"] >= 0


def test_an_outage_past_the_bound_or_at_the_end_is_a_loss(monkeypatch):
    graph = Graph()
    monitor = graph.monitor(monkeypatch, bound=0.05)
    graph.router["instance-1"] = {"epoch": 0, "state": "stalled"}  # work waits, no step
    monitor.look()
    time.sleep(0.1)
    monitor.look()
    assert "instance-1" in monitor.lost and "over 0 s" in monitor.lost["instance-1"]["why"]
    graph = Graph()
    monitor = graph.monitor(monkeypatch, bound=600.0)
    graph.serve["instance-0"] = "DEPLOYING"
    monitor.look()
    monitor.stop()  # its last look: still down
    assert "out of service when the run ended" in monitor.lost["instance-0"]["why"]


def test_without_a_bound_being_out_of_service_is_a_loss_at_once(monkeypatch):
    graph = Graph()
    monitor = graph.monitor(monkeypatch, bound=None)
    graph.router["instance-0"] = {"epoch": 0, "state": "stalled"}  # a stall is no loss here
    monitor.look()
    assert not monitor.lost
    graph.serve["instance-1"] = "UNHEALTHY"
    monitor.look()
    assert set(monitor.lost) == {"instance-1"}


# ---- probes, audit, result ---------------------------------------------------------------------
def test_probes_are_counted_and_their_answers_judged():
    tally = Tally()
    ok = Probe((5, 6, 7), CachedTokens(0, 0, 64, 0))
    records = [ProbeRecord(1.0, 2.0, "instance-0", (1, 2, 3), ok),
               ProbeRecord(3.0, 4.0, "instance-1", (1, 2, 3, 4), Probe((), None, "gone"))]
    record_probes(tally, records, lambda t: bytes([t]))
    assert (tally.sent, tally.answered, tally.server_errors) == (2, 1, 1)
    (answer,) = tally.answers
    assert answer.kind is AnswerKind.PROBE and answer.prompt == (1, 2, 3)
    assert answer.choices == ((b"\x05", b"\x06", b"\x07"),) and answer.ignore_eos
    assert "instance-1: gone" in tally.errors[0].cause


def test_the_engine_audit_and_the_result():
    audit = EngineAudits(2, 1, True, {"instance-0": {"idle": True, "blocks_in_use": 2}})
    assert not audit.clean and EngineAudits(0, 0, True, {}).clean
    assert not EngineAudits(0, 0, False, {}).clean  # a request still ran: audited again
    settings = chaos.ServeSettings(model="tiny", instances=2, storage_backend=None)
    served = chaos.Served(Tally(sent=1, answered=1), [], audit, "", {}, {}, {}, True, 1.0,
                          {"instance-0": [{"at_s": 1.0, "down_s": 50.0, "why": "killed"}]}, 3,
                          "tmpfs")
    out = chaos.result_json(chaos.ChaosParams(engine=VLLM), settings, served,
                            chaos.Judgement(1, 1, 0, 0, []))
    assert (out["leaked_pages"], out["leaked_locks"], out["open_tickets"]) == (2, 1, None)
    assert out["engine_audit"] == audit.by_instance and out["probes"] == 3
    assert out["recoveries"]["instance-0"][0]["down_s"] == 50.0 and out["l3_volume"] == "tmpfs"
    assert out["missed"] == ["leaked_pages", "leaked_locks"]
    json.dumps(out)


def test_the_audit_waits_for_a_new_engine_in_place_of_a_killed_one(monkeypatch):
    """An engine killed just before the traffic ended: its instance is back once it runs an
    engine none of whose processes was the killed engine's (a worker killed leaves the
    EngineCore running a while: that is not back)."""
    import threading
    from types import SimpleNamespace

    from kvtier.bench import chaos_vllm
    from kvtier.vllm_engine.processes import EngineProcesses

    targets = [SimpleNamespace(name="instance-0"), SimpleNamespace(name="instance-1")]
    now = {"instance-0": EngineProcesses((10,), (11,)), "instance-1": EngineProcesses((20,), (21,))}

    def processes(target, timeout_s=None):
        got = now[target.name]
        if got is None:
            raise RuntimeError("the replica is being replaced")
        return got
    faults = object.__new__(chaos_vllm.VllmFaults)
    faults.engines = SimpleNamespace(targets=targets, processes=processes)
    faults.rng, faults._killed, faults._lock = random.Random(3), set(), threading.Lock()
    signalled = []
    monkeypatch.setattr(chaos_vllm, "_signal", lambda pids, sig: signalled.extend(pids) or True)
    assert faults.engines_back()  # nothing killed
    armed, where = faults.kill_engine()
    assert armed and signalled
    victim = "instance-0" if signalled[0] in (10, 11) else "instance-1"
    old = now[victim]
    assert victim in where and not faults.engines_back()  # its processes still listed
    now[victim] = EngineProcesses(old.cores, ())  # the killed worker gone, its core not yet
    assert not faults.engines_back()
    now[victim] = None  # Serve replaces the replica
    assert not faults.engines_back()
    now[victim] = EngineProcesses((30,), (31,))  # a new engine
    assert faults.engines_back()


# ---- the file L3's faults ------------------------------------------------------------------------
def objects(root, count: int) -> list[str]:
    folder = root / "ns" / "kv"
    folder.mkdir(parents=True)
    paths = []
    for i in range(count):
        path = folder / f"{i:064x}_h0_k"
        path.write_bytes(b"H" * HEADER_BYTES + bytes(range(256)))
        paths.append(str(path))
    (folder / ".tmp-object").write_bytes(b"x" * 1000)  # a writer's temp file: never touched
    return paths


def test_corruption_overwrites_the_payload_of_new_objects_only(tmp_path, monkeypatch):
    monkeypatch.setattr(chaos_l3, "_mount_tmpfs", lambda root, size: False)
    volume = chaos_l3.L3Volume(str(tmp_path / "l3"))
    old, new = objects(tmp_path / "l3", 2)
    os.utime(old, (time.time() - 60, time.time() - 60))
    assert volume.corrupt(time.time() - 30) == 1
    data = open(new, "rb").read()
    assert data[:HEADER_BYTES] == b"H" * HEADER_BYTES and data[HEADER_BYTES:] != bytes(range(256))
    assert len(data) == HEADER_BYTES + 256
    assert open(old, "rb").read()[HEADER_BYTES:] == bytes(range(256))
    assert (tmp_path / "l3" / "ns" / "kv" / ".tmp-object").read_bytes() == b"x" * 1000
    assert volume.fill() == 0 and "not a file system of its own" in volume.why_not
    volume.close()


def test_a_tmpfs_volume_fills_up_and_empties(tmp_path):
    volume = chaos_l3.L3Volume(str(tmp_path / "l3"), size_bytes=4 << 20)
    try:
        if not volume.mounted:
            pytest.skip("this process may not mount a tmpfs (not root, or not allowed)")
        assert volume.fill() >= 3 << 20 and volume.free_bytes() == 0
        with pytest.raises(OSError):
            with open(tmp_path / "l3" / "page", "wb") as f:
                f.write(b"x" * 8192)
        volume.drain()
        (tmp_path / "l3" / "page").write_bytes(b"x" * 8192)
    finally:
        volume.close()
    assert not os.path.ismount(tmp_path / "l3")


def test_late_reads_write_the_fault_file_the_ranks_follow(tmp_path):
    from kvtier.backends.faulty import FaultKind, FileRule, StorageOp

    late = chaos_l3.LateReads(str(tmp_path / "faults.json"))
    assert json.loads((tmp_path / "faults.json").read_text()) == [] and late.hits() == 0
    late.delay(first_head=3, delay_s=4.0)
    (rule,) = [FileRule.from_dict(d) for d in json.loads((tmp_path / "faults.json").read_text())]
    assert rule == FileRule(StorageOp.GET, FaultKind.DELAY, 4.0, 3)
    late.clear()
    assert json.loads((tmp_path / "faults.json").read_text()) == []
