"""The instance server's hand-over between callers' threads and its driver thread, without Ray:
commands from many threads at once never stop the instance, and every request is answered or
cancelled exactly once."""
from __future__ import annotations

import inspect
import threading
import time
from collections import deque

from eventually import eventually

from kvtier.actors.instance import Instance, InstanceStep
from kvtier.actors.instance_server import DrivenInstance, InstanceServer
from kvtier.actors.pd.deployment import PDInstances
from kvtier.engine.request import CachedTokens, FinishReason, Output
from kvtier.engine.sampling import SamplingParams
from kvtier.tiers.cache_types import RequestLengths


class InstantInstance:
    """Answers every request with one token at its first step (an Instance's interface)."""

    restarts = 0
    recovering = False
    events_when_idle = False

    def __init__(self) -> None:
        self._running: deque[int] = deque()
        self.labels: list[str] = []

    def watch_cache(self, name: str) -> None:
        pass

    def drain_events(self) -> None:
        return None

    def add_request(self, tokens, sampling, cache_salt="", resume=None,
                    request_id=None, label="") -> int:
        self._running.append(request_id)
        self.labels.append(label)
        return request_id

    def abort(self, request_id: int) -> None:
        if request_id in self._running:
            self._running.remove(request_id)

    def step_report(self) -> InstanceStep:
        done = []
        while self._running:
            done.append(Output(self._running.popleft(), (1,), (7,), None, FinishReason.LENGTH,
                               RequestLengths(0, 0, 0, 0, 1), CachedTokens(0, 0, 0), 0.0, None))
        return InstanceStep(done, {}, None)

    @property
    def num_pending(self) -> int:
        return len(self._running)

    def close(self) -> None:
        pass


def test_commands_from_many_threads_never_stop_the_instance():
    """Cancels of requests that finished already (a client gone after its last token) come
    while other threads queue requests: the driver thread used to scan the shared command
    deque for them while callers appended to it ('deque mutated during iteration', and the
    instance stopped serving every request)."""
    server = InstanceServer(InstantInstance(), "race")
    done = threading.Semaphore(0)

    def caller() -> None:
        keys = [server.submit([1, 2], SamplingParams(max_new_tokens=1),
                              lambda _: done.release()) for _ in range(200)]
        time.sleep(0.001)
        for key in keys:  # most have finished: the server must find nothing to cancel
            server.cancel(key)

    deadline = time.monotonic() + 3.0
    try:
        while time.monotonic() < deadline and not server.broken:
            threads = [threading.Thread(target=caller) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert server.broken is None, server.broken
        eventually(lambda: server.poll().load == 0, 10, "every request answered or cancelled")
    finally:
        server.close()


def test_the_instance_is_given_the_id_the_client_knows():
    instance = InstantInstance()
    server = InstanceServer(instance, "labels")
    done = threading.Semaphore(0)
    try:
        server.submit([1, 2], SamplingParams(max_new_tokens=1), lambda _: done.release(),
                      label="chatcmpl-7")
        server.submit([1, 2], SamplingParams(max_new_tokens=1), lambda _: done.release())
        assert done.acquire(timeout=10) and done.acquire(timeout=10)
        assert instance.labels == ["chatcmpl-7", ""]
    finally:
        server.close()


def protocol_gaps(cls: type) -> list[str]:
    """How `cls` falls short of `DrivenInstance`: a property it lacks (as a property, a
    declared attribute or a class constant), a method it lacks or whose parameters differ."""
    gaps = []
    declared = {n for klass in cls.__mro__ for n in getattr(klass, "__annotations__", {})}
    for name, member in vars(DrivenInstance).items():
        if name.startswith("_"):
            continue
        got = getattr(cls, name, None)
        if isinstance(member, property):
            if not isinstance(got, property) and name not in declared \
                    and not isinstance(got, (int, bool)):
                gaps.append(f"{name}: not a property or declared attribute")
        elif not callable(got):
            gaps.append(f"{name}: missing")
        else:
            want = list(inspect.signature(member).parameters.values())
            have = list(inspect.signature(got).parameters.values())
            # the same parameters in the same order; each optional one optional here too
            if [p.name for p in have] != [p.name for p in want] or any(
                    w.default is not w.empty and h.default is h.empty
                    for w, h in zip(want, have)):
                gaps.append(f"{name}{inspect.signature(got)}: expected "
                            f"{inspect.signature(member)}")
    return gaps


def test_what_the_server_drives_conforms_to_its_protocol():
    """An Instance, a prefill/decode driver's PDInstances and this file's stand-in all take
    the server's request ids and report a step the same way."""
    from kvtier.vllm_engine.instance import VllmInstance

    assert protocol_gaps(Instance) == []
    assert protocol_gaps(PDInstances) == []
    assert protocol_gaps(VllmInstance) == []
    assert protocol_gaps(InstantInstance) == []

    class Lacking(InstantInstance):
        def add_request(self, tokens, sampling, cache_salt="", resume=None) -> int:
            return 0

    assert protocol_gaps(Lacking) != []  # the check can fail


class LoggingInstance(InstantInstance):
    """Each request's answer stores one page of the prompt in L1 (a cache event)."""

    def watch_cache(self, name: str) -> None:
        from kvtier.frontend.cache_events import CacheEventLog

        self.log = CacheEventLog(name)

    def step_report(self) -> InstanceStep:
        from kvtier.keys import KeyNamespace
        from kvtier.policies import CacheEventKind, CacheTier

        step = super().step_report()
        for out in step.finished:
            self.log.record(CacheEventKind.STORED, CacheTier.DEVICE,
                            KeyNamespace("m").page_hashes([out.request_id] * 4, 4))
        drained = self.log.drain()
        return step._replace(events=None if drained is None else drained.to_msgpack())


def test_a_full_poll_gives_what_the_instance_holds_in_place_of_the_events():
    """A router that starts again asks for holdings (`poll(full=True)`): every page its
    events ever stored, at the last batch's seq; the events before it are not sent again."""
    from kvtier.frontend.cache_events import CacheEventBatch

    server = InstanceServer(LoggingInstance(), "logging")
    try:
        assert server.poll(full=True).holdings is None  # nothing stored yet
        done = threading.Semaphore(0)
        for _ in range(3):
            server.submit([1], SamplingParams(max_new_tokens=1), lambda e: done.release())
            assert done.acquire(timeout=10)
        eventually(lambda: server.poll(full=False).events, 10, "the events of the answers")
        server.submit([1], SamplingParams(max_new_tokens=1), lambda e: done.release())
        assert done.acquire(timeout=10)
        eventually(lambda: server.poll().load == 0, 10, "the last answer")
        full = server.poll(full=True)
        held = CacheEventBatch.from_msgpack(full.holdings)
        assert full.events == () and held.instance == "logging" and held.seq >= 2
        assert len(held.events[0].page_hashes) == 4  # every page, also the polled ones
        assert server.poll().events == ()
    finally:
        server.close()
