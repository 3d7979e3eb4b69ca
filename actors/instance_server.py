"""An Instance behind a thread, for a server: requests come and go while the ranks step.

`Instance` is driven by one caller at a time (every call is a lockstep round over its rank
actors). A server has many concurrent requests, so `InstanceServer` owns the instance (a
`DrivenInstance`: an Instance, or a prefill/decode driver's instances, actors/pd/deployment) in one
driver thread: callers hand it commands (add a request, cancel one, run a maintenance call
between steps) through a thread-safe queue and get results through thread-safe callbacks.
While any request is pending the thread steps; otherwise it sleeps until a command arrives.

The server also keeps an index of the cache events it passed on (`holdings`): a router that
starts again, or that missed batches, asks for what the instance holds (`poll(full=True)`)
instead of waiting for every page to be touched again.

Per request the callback receives, in order: a `ServerEvent` of kind TOKENS whenever its
answer grows (a `Progress`: only the new tokens, each once, also across a rank restart),
then one of kind DONE (the `Output`; a request that failed by itself has
FinishReason.ERROR) or ERROR (the instance stopped serving: `message` says why).
"""
from __future__ import annotations

import concurrent.futures
import enum
import itertools
import logging
import queue
import threading
from collections import deque
from typing import Any, Callable, NamedTuple, Protocol, Sequence

from kvtier.actors.instance import InstanceError, InstanceStep
from kvtier.actors.step_wire import Progress
from kvtier.engine.request import Output, Resume
from kvtier.engine.sampling import SamplingParams
from kvtier.actors.l3.l2_reporter import L2Reporter
from kvtier.frontend.cache_events import CacheEvent, CacheEventBatch
from kvtier.frontend.records import ReplicaPoll
from kvtier.frontend.router_index import PrefixIndex
from kvtier.policies import CacheEventKind, CacheTier

log = logging.getLogger(__name__)

MAX_EVENT_BATCHES = 4096  # undrained cache-event batches kept; older ones are dropped
MAX_HOLDINGS_PAGES = 1 << 17  # pages per tier the server's index of its events keeps
IDLE_WAIT_S = 0.05


class ServerEventKind(enum.Enum):
    TOKENS = "tokens"  # `progress`: the answer's new tokens
    DONE = "done"      # `output`: the request finished (its FinishReason says how)
    ERROR = "error"    # `message`: the instance stopped serving; the request is not answered


class ServerEvent(NamedTuple):
    kind: ServerEventKind
    progress: Progress | None = None
    output: Any = None  # an Output (or what the driven instance returns: a PDOutput)
    message: str = ""


Sink = Callable[[ServerEvent], None]


class DrivenInstance(Protocol):
    """What an `InstanceServer` drives: an `Instance` (actors/instance) or a prefill/decode
    driver's instances (`PDInstances`, actors/pd/deployment). Request ids are the server's: each
    request is added under the id the server gives it, and keeps it to its end."""

    @property
    def restarts(self) -> int:
        """Rank-set restarts so far."""

    @property
    def recovering(self) -> bool:
        """Replacing its ranks now (read from other threads)."""

    @property
    def num_pending(self) -> int:
        """Requests added and not yet returned."""

    @property
    def events_when_idle(self) -> bool:
        """Its cache events may arrive between steps (an engine of its own publishes them
        from another process): the server drains them while it is idle too."""

    def watch_cache(self, name: str) -> None:
        """Report cache events under `name` with every step."""

    def drain_events(self) -> bytes | None:
        """Cache events recorded outside steps (a maintenance call's)."""

    def add_request(self, tokens: Sequence[int], sampling: SamplingParams,
                    cache_salt: str = "", resume: Resume | None = None,
                    request_id: int | None = None, label: str = "") -> int:
        """Queue a request under `request_id`; that id. `label`: its id as its client knows
        it (the OpenAI id), for the logs (and an engine that names requests: vLLM's)."""

    def abort(self, request_id: int) -> object:
        """Stop a request; its sink hears nothing more of it."""

    def step_report(self) -> InstanceStep:
        """One step: the finished requests, the answers that grew, the cache events."""

    def close(self) -> None:
        """Stop everything it runs."""


class _Add(NamedTuple):
    request_id: int
    tokens: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str
    sink: Sink
    resume: Resume | None
    label: str


class _Cancel(NamedTuple):
    request_id: int


class _Call(NamedTuple):
    fn: Callable[[Any], Any]  # given the driven instance
    future: concurrent.futures.Future


class InstanceServer:
    """`instance` driven by a thread; `submit`, `cancel`, `call`, `poll`, `close`."""

    def __init__(self, instance: DrivenInstance, name: str) -> None:
        self.instance, self.name = instance, name
        instance.watch_cache(name)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count(1)  # request ids: the instance's too
        self._sinks: dict[int, Sink] = {}  # request id -> its caller, while it runs
        self._events: deque[bytes] = deque(maxlen=MAX_EVENT_BATCHES)
        self._holdings = PrefixIndex(MAX_HOLDINGS_PAGES, MAX_HOLDINGS_PAGES)  # its events
        self._holdings_epoch = instance.restarts
        self._l2: L2Reporter | None = None  # tells the namespace directory its L2 pages
        self._lock = threading.Lock()  # guards broken, the queue's last puts, _events and
        # the counters read by poll
        self._load = 0
        self._steps = 0
        self.broken: str | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{name}", daemon=True)
        self._thread.start()

    # ---- callers (any thread) ---------------------------------------------------------------
    def submit(self, tokens: list[int], sampling: SamplingParams, sink: Sink,
               cache_salt: str = "", resume: Resume | None = None, label: str = "") -> int:
        """Queue a request (`cache_salt`: its tenant's; `resume`: the start of its answer
        the caller already has; `label`: its id as its client knows it); its id here (for
        `cancel`)."""
        request_id = next(self._ids)
        with self._lock:  # after _fail_all nothing is queued that nobody would answer
            if self.broken:
                raise InstanceError(f"instance {self.name} stopped serving: {self.broken}")
            self._load += 1
            self._commands.put(_Add(request_id, tuple(tokens), sampling, cache_salt, sink,
                                    resume, label))
        self._wake.set()
        return request_id

    def cancel(self, request_id: int) -> None:
        """Abort the request (a client went away); its sink hears nothing more."""
        self._put(_Cancel(request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run `fn(instance)` in the driver thread between two steps (maintenance: flush,
        attach L3, stats); its result as a future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_Call(fn, future))
        return future

    def _put(self, cmd: Any) -> None:
        with self._lock:
            if self.broken:  # nobody drains the queue any more
                if isinstance(cmd, _Call):
                    cmd.future.set_exception(InstanceError(
                        f"instance {self.name} stopped serving: {self.broken}"))
                return
            self._commands.put(cmd)
        self._wake.set()

    def poll(self, full: bool = False) -> ReplicaPoll:
        """Load, epoch, steps and the cache events since the last poll; `full`: what the
        instance holds instead of those events (a router rebuilding its index)."""
        with self._lock:
            events = tuple(self._events)
            self._events.clear()
            holdings = None
            if full:
                snapshot = self._holdings.holdings(self.name)
                events, holdings = (), None if snapshot is None else snapshot.to_msgpack()
            return ReplicaPoll(self._load, self.instance.restarts, events, self.broken,
                               self._steps, self.instance.recovering, holdings)

    def report_l2(self, reporter: L2Reporter | None) -> None:
        """From now on tell `reporter` the L2 pages its events say the instance holds, and
        gains and loses (None: stop; the reporter before closes, so the directory forgets
        them). For an instance whose event keys are its L3 namespace's page keys."""
        with self._lock:
            before, self._l2 = self._l2, reporter
            snapshot = self._holdings.holdings(self.name) if reporter is not None else None
            if snapshot is not None:  # what it holds already (all STORED)
                _tell_l2(reporter, snapshot.events)
        if before is not None:
            before.close()

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout_s)
        try:
            self.instance.close()
        finally:
            self.report_l2(None)

    # ---- the driver thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_commands()
                if self.instance.num_pending == 0:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    if self.instance.events_when_idle:
                        self._keep_events(self.instance.drain_events())
                    continue
                self._step()
        except Exception as exc:  # noqa: BLE001 - every waiting caller must hear why
            log.exception("instance %s stopped serving", self.name)
            self._fail_all(f"{type(exc).__name__}: {exc}")

    def _drain_commands(self) -> None:
        """Every command queued so far, in order (a request's cancel always comes after its
        add: the caller has the id only once `submit` queued the add)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Call):
                if cmd.future.set_running_or_notify_cancel():
                    try:
                        cmd.future.set_result(cmd.fn(self.instance))
                    except Exception as exc:  # noqa: BLE001 - the caller gets it
                        cmd.future.set_exception(exc)
                    self._keep_events(self.instance.drain_events())
            else:
                self._cancel(cmd.request_id)

    def _add(self, cmd: _Add) -> None:
        self.instance.add_request(cmd.tokens, cmd.sampling, cmd.cache_salt, cmd.resume,
                                  cmd.request_id, label=cmd.label)
        self._sinks[cmd.request_id] = cmd.sink

    def _cancel(self, request_id: int) -> None:
        if self._sinks.pop(request_id, None) is None:
            return  # finished already (its add was handled before this cancel)
        self.instance.abort(request_id)
        self._done_one()

    def _step(self) -> None:
        report = self.instance.step_report()
        with self._lock:
            self._steps += 1
        self._keep_events(report.events)
        for req_id, progress in report.progress.items():
            sink = self._sinks.get(req_id)
            if sink is not None:
                sink(ServerEvent(ServerEventKind.TOKENS, progress=progress))
        for out in report.finished:
            sink = self._sinks.pop(out.request_id, None)
            if sink is not None:
                sink(ServerEvent(ServerEventKind.DONE, output=out))
                self._done_one()

    def _keep_events(self, batch: bytes | None) -> None:
        if batch is None:
            return
        decoded = CacheEventBatch.from_msgpack(batch)
        with self._lock:
            l2 = self._l2
            if self._holdings_epoch != self.instance.restarts:  # new ranks: events from 1
                self._holdings.forget(self.name)
                self._holdings_epoch = self.instance.restarts
                if l2 is not None:
                    l2.cleared()
            self._holdings.apply(decoded)
            self._events.append(batch)
            if l2 is not None:
                _tell_l2(l2, decoded.events)

    def _done_one(self) -> None:
        with self._lock:
            self._load -= 1

    def _fail_all(self, why: str) -> None:
        with self._lock:  # no command is queued after this
            self.broken = why
        failed = ServerEvent(ServerEventKind.ERROR, message=why)
        for sink in self._sinks.values():
            sink(failed)
        self._sinks.clear()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                cmd.sink(failed)
            elif isinstance(cmd, _Call):
                cmd.future.set_exception(InstanceError(why))


def _tell_l2(reporter: L2Reporter, events: Sequence[CacheEvent]) -> None:
    """The L2 (host tier) pages `events` stored and evicted, told to `reporter`."""
    for event in events:
        if event.tier is not CacheTier.HOST:
            continue
        if event.kind is CacheEventKind.STORED:
            reporter.held(event.page_hashes)
        elif event.kind is CacheEventKind.EVICTED:
            reporter.dropped(event.page_hashes)
