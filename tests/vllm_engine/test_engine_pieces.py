"""Pieces of the vLLM instance that need no engine: its processes found by their titles, a dead
engine waking what waits on it, and kvtier's sampling settings as vLLM's (stop ids past the
vocabulary, explicit stop sets) and seeded requests held until one step prefills them."""
from __future__ import annotations

import concurrent.futures
import queue
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from vllm_required import require_vllm

from kvtier.engine.sampling import SamplingParams
from kvtier.vllm_engine.engine_watch import EngineWatch
from kvtier.vllm_engine.processes import engine_processes

require_vllm()

# a process titled like vLLM's EngineCore, whose child is titled like a worker
TITLED = """
import setproctitle, subprocess, sys, time
setproctitle.setproctitle("VLLM::EngineCore")
child = subprocess.Popen([sys.executable, "-c", "import setproctitle, time; "
                          "setproctitle.setproctitle('VLLM::Worker_TP0'); time.sleep(60)"])
print("ready", flush=True)
time.sleep(60)
child.kill()
"""


def test_an_engines_processes_are_found_under_the_process_that_started_it():
    core = subprocess.Popen([sys.executable, "-c", TITLED], stdout=subprocess.PIPE, text=True)
    try:
        assert core.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        found = engine_processes(core.pid)
        while not found.workers and time.monotonic() < deadline:  # the worker titles itself
            time.sleep(0.05)
            found = engine_processes(core.pid)
        assert found.cores == (core.pid,) and len(found.workers) == 1
        assert core.pid in engine_processes().cores  # from this process, its parent
    finally:
        for pid in engine_processes(core.pid).workers:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        core.kill()
        core.wait(10)


def test_a_dead_engine_wakes_the_step_and_the_call_waiting_on_it():
    from vllm.v1.engine.exceptions import EngineDeadError

    pending: concurrent.futures.Future = concurrent.futures.Future()
    client = SimpleNamespace(resources=SimpleNamespace(engine_dead=False),
                             outputs_queue=queue.Queue(), utility_results={1: pending})
    watch = EngineWatch(client, interval_s=0.01)
    time.sleep(0.05)
    assert client.outputs_queue.empty() and not pending.done()  # alive: nothing happens
    client.resources.engine_dead = True
    assert isinstance(client.outputs_queue.get(timeout=5), EngineDeadError)
    with pytest.raises(EngineDeadError):
        pending.result(timeout=5)
    watch.close()
    EngineWatch(SimpleNamespace()).close()  # an in-process client: nothing to watch


def test_sampling_settings_as_vllms():
    from kvtier.vllm_engine.instance import vllm_sampling

    explicit = vllm_sampling(SamplingParams(stop_token_ids=(2, 49152, 7), seed=3), 0, 49152)
    assert explicit.stop_token_ids == [2, 7] and explicit.ignore_eos  # the whole stop set
    assert explicit.seed == 3
    model_stops = vllm_sampling(SamplingParams(), 0, 49152)
    assert model_stops.stop_token_ids == [] and not model_stops.ignore_eos  # vLLM's own EOS
    assert vllm_sampling(SamplingParams(stop_token_ids=()), 0).ignore_eos


def test_a_request_id_in_vllm_names_the_client_id_and_keeps_the_server_id():
    from kvtier.vllm_engine.instance import server_request_id, vllm_request_id

    assert vllm_request_id(7, "") == "7" and server_request_id("7") == 7
    named = vllm_request_id(12, "chatcmpl-0f3a/1")
    assert named.startswith("chatcmpl-0f3a/1") and server_request_id(named) == 12
    assert server_request_id(vllm_request_id(3, "odd@label")) == 3  # '@' in the label too


def pending(request_id: int, prompt: int, seed: int | None = None, temperature: float = 1.0):
    from kvtier.vllm_engine.seed_gate import Pending

    return Pending(request_id, tuple(range(prompt)), SamplingParams(temperature=temperature,
                                                                    seed=seed), "", None)


def test_a_seeded_request_goes_to_vllm_only_when_one_step_prefills_it_whole():
    from kvtier.vllm_engine.seed_gate import SeedGate

    gate = SeedGate(budget_tokens=128, active=True)
    assert gate.admit(pending(1, 100)) is not None  # unseeded: at once
    assert gate.admit(pending(2, 50, seed=0, temperature=0.0)) is not None  # greedy: at once
    assert gate.admit(pending(3, 100, seed=7)) is None  # seeded and sampled: held
    assert gate.admit(pending(4, 10)) is None  # behind it, in order
    assert gate.release(prefilling=[1], running=2) == []  # request 1 is being prefilled
    assert gate.release(prefilling=[], running=29) == []  # 100 + 29 decodes > 128
    assert [p.request_id for p in gate.release(prefilling=[], running=2)] == [3]  # alone
    assert gate.admit(pending(5, 10)) is None  # nothing else while 3 has no token
    assert gate.release(prefilling=[3], running=3) == []
    assert [p.request_id for p in gate.release(prefilling=[], running=3)] == [4, 5]
    assert len(gate) == 0


def test_a_seeded_prompt_no_step_holds_loses_its_seed_and_the_gate_can_be_off():
    from kvtier.vllm_engine.seed_gate import SeedGate

    gate = SeedGate(budget_tokens=128, active=True)
    long = gate.admit(pending(1, 200, seed=7))
    assert long is not None and long.sampling.seed is None and long.sampling.temperature == 1.0
    assert gate.admit(pending(2, 100, seed=7)) is None and gate.drop(2) and len(gate) == 0
    off = SeedGate(budget_tokens=128, active=False)  # not vLLM's CPU build
    assert off.admit(pending(3, 200, seed=7)).sampling.seed == 7
