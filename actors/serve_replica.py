"""What every serving deployment of the graph shares: one `InstanceServer` in its replica
(over an Instance, or over a prefill/decode driver's instances), a request's answer streamed
from it, the router's poll, health, and L3 attached on every instance it serves with.

A base of `InstanceDeployment` and `PDDeployment`: each reads its settings (`_open`), builds
its server (`_serve`) and says what a request's last item adds (`_final`) and which Instances
it serves with (`_members`).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

import torch

from kvtier.actors.instance import Instance, InstanceError
from kvtier.actors.instance_server import InstanceServer, ServerEventKind
from kvtier.actors.l3.l2_reporter import L2Reporter
from kvtier.actors.ray_env import keep_serve_replica_on_loopback
from kvtier.actors.step_wire import decode_resume, decode_sampling
from kvtier.engine.request import FinishReason
from kvtier.errors import ConfigError
from kvtier.messages import NamespaceSpec, pack_record
from kvtier.policies import StorageBackendKind
from kvtier.frontend.l3_bound import GiB, L3Bound, auto_l3_gb
from kvtier.frontend.metrics import RankFaults
from kvtier.frontend.placement import head_resources
from kvtier.frontend.records import (AnswerFinal, AnswerItem, AnswerItemKind, InstanceSnapshot,
                                     L3Attachment, ReplicaDescription, ReplicaSnapshot,
                                     ReplicaStorage)
from kvtier.frontend.settings import ServeSettings
from kvtier.storage_options import parse_storage_options
from kvtier.tiers.l2_holders import new_incarnation

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 120.0
# With L3 off and peers on, the namespace the instances find each other through is registered
# as a file namespace (the namespace actor opens a backend for every namespace); nothing
# writes to its storage, as no rank attaches it (RankL3Link, `storage` False).
DIRECTORY_BACKEND = StorageBackendKind.FILE


def l3_options(kind: StorageBackendKind, s: ServeSettings, options: dict | None) -> dict:
    """The backend options a namespace is registered with (validated); file and nixl keep
    their pages under the deployment's L3 directory unless the caller names one, bounded by
    l3_max_gb (the namespace's quota) unless the caller bounds them (max_size_bytes; 0:
    unbounded). An `auto` bound still unmeasured is measured at the root now: callers that
    attach several instances at once measure it first, once (serve_graph.resolve at start,
    `bound_attach_options` for the admin API), since every instance registers the same spec.
    Mooncake's master bounds its own store: l3_max_gb does not apply to it. The deployment's
    `l3_options` come first for its own backend (the caller's options win)."""
    opts = {**(s.l3_options if kind is s.storage_backend else {}), **(options or {})}
    on_disk = kind in (StorageBackendKind.FILE, StorageBackendKind.NIXL)
    if on_disk and "root_dir" not in opts:
        if not s.l3_root:
            raise ConfigError("the file and nixl backends need a directory: set l3_root or "
                              "give options.root_dir")
        opts["root_dir"] = s.l3_root
    if on_disk and "max_size_bytes" not in opts and s.l3_max_gb is not L3Bound.UNBOUNDED:
        gb = s.l3_max_gb
        if gb is L3Bound.AUTO:
            gb = auto_l3_gb(str(opts["root_dir"]))
        opts["max_size_bytes"] = max(1, int(gb * GiB))
    parse_storage_options(kind, opts)  # ConfigError names a bad key or value
    return opts


def bound_attach_options(s: ServeSettings, body: dict) -> dict | None:
    """The options of an admin attach (`body`: its JSON), with an `auto` bound measured once
    for every instance: written into `body`, which each instance's call then reads."""
    kind = StorageBackendKind.parse(body["backend"], "backend")
    if kind in (StorageBackendKind.FILE, StorageBackendKind.NIXL) \
            and s.l3_max_gb is L3Bound.AUTO and "max_size_bytes" not in (body.get("options") or {}):
        body["options"] = l3_options(kind, s, body.get("options"))
    return body.get("options")


def final_fields(out: Any, name: str) -> AnswerFinal:
    """What an answer's last item says of its run: finish reason, cached tokens by tier, the
    five lengths, the instance-side TTFT and queue time, the instance."""
    return AnswerFinal.of(out, name)


def _last_item(out: Any, have: int, final: AnswerFinal | None) -> AnswerItem:
    """A finished answer's last item: its tokens after the first `have` (and their
    log-probabilities, which belong to the answer's last tokens), with `final`, or, without
    one, the output's error."""
    rest = tuple(out.tokens[have:])
    lps = None if out.logprobs is None else out.logprobs[len(out.logprobs) - len(rest):]
    if final is None:
        return AnswerItem(AnswerItemKind.ERROR, rest, lps, error=out.error or "it failed")
    return AnswerItem(AnswerItemKind.FINAL, rest, lps, final=final)


class ServedReplica:
    """`generate`, `poll`, `describe`, `attach_l3`/`detach_l3`/`storage`, health and
    maintenance calls over `self.server`."""

    name: str
    settings: ServeSettings
    server: InstanceServer
    l3: L3Attachment | None = None
    directory_only: bool = False  # L3 off, peers on: the namespace's directory alone

    def _open(self, name: str, settings: dict) -> ServeSettings:
        """The replica's process set up for serving (loopback, one torch thread: the ranks
        compute); this deployment's settings."""
        keep_serve_replica_on_loopback()
        torch.set_num_threads(1)
        self.name, self.settings = name, ServeSettings.from_mapping(settings)
        return self.settings

    def _serve(self, server: InstanceServer) -> None:
        """Serve with `server`, L3 attached as the settings say."""
        self.server, s = server, self.settings
        if s.storage_backend is not None:
            self._attach(s.storage_backend, l3_options(s.storage_backend, s, None))
        elif s.peer_transport is not None:
            self._attach_directory()

    def _final(self, out: Any) -> AnswerFinal:
        """How a request's run went, for its last item (`final_fields` and more)."""
        raise NotImplementedError

    def _members(self, target: Any) -> list[Instance]:
        """The Instances behind what `self.server` drives (`target`)."""
        raise NotImplementedError

    def _member_names(self) -> list[str]:
        """The names of `_members`, in order (the metrics label each instance's figures)."""
        return [self.name]

    # ---- requests ---------------------------------------------------------------------------
    async def generate(self, tokens: list[int], sampling: bytes, cache_salt: str = "",
                       resume: bytes | None = None, request_id: str = ""
                       ) -> AsyncIterator[bytes]:
        """Stream `AnswerItem` records (msgpack): new token ids (and their log-probabilities
        when it asked), the last one FINAL with `_final`: the finish reason, cached tokens by
        tier, the five lengths, the instance-side TTFT; or, when this request alone failed,
        ERROR with why (in words a client may read) instead. `cache_salt`: the request's
        tenant (it hits only prefixes cached with the same salt). `sampling`: a SamplingParams
        record (step_wire `encode_sampling`). `resume` (a Resume record or None): the
        start of its answer the caller already has (it ran on another instance): the answer
        goes on after it and those tokens are not sent again. `request_id`: its id as the
        client knows it (the instance's logs and engine carry it). A caller that goes away
        (disconnect, stop string) cancels it. The instance stopping raises InstanceError."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        got = decode_resume(resume)
        key = self.server.submit(
            tokens, decode_sampling(sampling),
            lambda event: loop.call_soon_threadsafe(events.put_nowait, event), cache_salt, got,
            label=request_id)
        have, finished = (0 if got is None else len(got.tokens)), False
        try:
            while True:
                event = await events.get()
                if event.kind is ServerEventKind.TOKENS:
                    new = event.progress.after(have)
                    if new is not None:
                        yield AnswerItem.more(new.tokens, new.logprobs).to_msgpack()
                        have = new.stop
                elif event.kind is ServerEventKind.DONE:
                    finished, out = True, event.output
                    final = None if out.finish_reason is FinishReason.ERROR \
                        else self._final(out)
                    yield _last_item(out, have, final).to_msgpack()
                    return
                else:
                    finished = True
                    raise InstanceError(f"instance {self.name} stopped serving: "
                                        f"{event.message}")
        finally:
            if not finished:  # the caller went away (disconnect, stop string): free it
                self.server.cancel(key)

    # ---- router and operator calls ------------------------------------------------------------
    async def poll(self, full: bool = False) -> bytes:
        """A `ReplicaPoll` record (msgpack); `full`: with what the instance holds in place of
        the events since the last poll (a router rebuilding its index)."""
        return self.server.poll(full).to_msgpack()

    async def describe(self) -> bytes:
        """The first instance's cache (every instance is built from the same settings): a
        `ReplicaDescription` record (msgpack)."""
        desc = await self._call(lambda target: self._members(target)[0].describe())
        return ReplicaDescription.of(desc, self.name, self.settings.tp_size).to_msgpack()

    async def attach_l3(self, backend: str, options: dict | None) -> bytes:
        """A `ReplicaStorage` record (msgpack) of what it attached."""
        kind = StorageBackendKind.parse(backend, "backend")
        opts = l3_options(kind, self.settings, options)
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._attach(kind, opts).to_msgpack())

    async def detach_l3(self) -> bytes:
        await asyncio.get_running_loop().run_in_executor(None, self._detach)
        if self.settings.peer_transport is not None:  # peers keep the namespace's directory
            await asyncio.get_running_loop().run_in_executor(None, self._attach_directory)
        return ReplicaStorage(self.name, None).to_msgpack()

    async def storage(self) -> bytes:
        """A `ReplicaStorage` record (msgpack)."""
        return ReplicaStorage(self.name, self.l3).to_msgpack()

    async def snapshot(self) -> bytes:
        """A `ReplicaSnapshot` record (msgpack): each instance's counters and pool use."""
        return ReplicaSnapshot(await self._call(lambda target: tuple(
            instance_snapshot(inst, name)
            for name, inst in zip(self._member_names(), self._members(target))))).to_msgpack()

    # ---- fault injection and the leak audit (kvtier bench chaos: actors/chaos_faults.py) -----
    async def kill_rank(self, member: int, rank: int) -> bool:
        """Kill rank `rank` of instance `member` (`_members` order) now, in the middle of a
        step or not, without waiting for the driver thread: the instance notices at its next
        call and replaces its ranks. False when its ranks are being replaced already."""
        try:
            self._members(self.server.instance)[member].kill_rank(rank)
        except IndexError:  # no ranks right now: a replacement set is starting
            return False
        return True

    async def audit(self) -> list[list[bytes]]:
        """Every rank's `audit` (pages outside the tree, locked and protected nodes, after
        its copies settle), per instance in `_members` order, between two steps: CacheAudit
        records."""
        return await self._call(lambda target: [[pack_record(a) for a in inst.rank_group.audit()]
                                                for inst in self._members(target)])

    def check_health(self) -> None:
        if self.server.broken:
            raise RuntimeError(f"instance {self.name} stopped serving: {self.server.broken}")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()

    # ---- helpers ------------------------------------------------------------------------------
    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(target)` in the server's driver thread, between two steps."""
        future = self.server.call(fn)
        return await asyncio.wait_for(asyncio.wrap_future(future), CALL_TIMEOUT_S)

    def _l3_members(self, target: Any) -> list[Instance]:
        """The instances that attach the deployment's L3 namespace."""
        return self._members(target)

    def _detach(self) -> None:
        """Every instance lets go of its L3 namespace (its storage, or its directory alone);
        the directory forgets this replica's L2 pages and peers."""
        self.server.call(lambda target: [inst.detach_l3() for inst in self._l3_members(target)]
                         ).result(CALL_TIMEOUT_S)
        self.server.report_l2(None)
        self.l3, self.directory_only = None, False

    def _attach_directory(self) -> None:
        """L3 off, peers on: the namespace's directory alone (registered on a file root that
        nothing writes), through which the instances find each other's L2 pages."""
        self._attach(DIRECTORY_BACKEND, l3_options(DIRECTORY_BACKEND, self.settings, None),
                     storage=False)

    def _attach(self, kind: StorageBackendKind, options: dict,
                storage: bool = True) -> ReplicaStorage:
        """Register the namespace of this deployment's instances with the namespace actor
        (created if need be; idempotent: every deployment of the graph registers the same
        one) and attach it on every rank of every instance (`storage` False: its directory
        alone, for peers). With peers on, every instance lends and reads L2 pages."""
        from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor

        if self.l3 is not None:
            raise ConfigError(f"instance {self.name} has L3 attached already "
                              f"({self.l3.backend.value}); detach it first")
        if self.directory_only:  # storage attached now: in place of the directory alone
            self._detach()
        server, s = self.server, self.settings
        desc = server.call(lambda target: self._members(target)[0].describe()
                           ).result(CALL_TIMEOUT_S)
        client = get_or_create_namespace_actor(s.l3_actor, s.l3_state_dir or None,
                                               resources=head_resources(s))
        info = client.register(NamespaceSpec(desc.model, desc.tenant_salt,
                                             desc.layout_fingerprint, kind, options,
                                             kv_heads=desc.kv_heads,
                                             page_bytes=desc.page_bytes,
                                             sliding=desc.sliding))
        server.call(lambda target: [inst.attach_l3(info, s.l3_actor, storage)
                                    for inst in self._l3_members(target)]
                    ).result(CALL_TIMEOUT_S)
        # this attachment's start in the directory's L2 listing: its ranks' contacts and the
        # server's reports carry it, so a later replica of the same name is told apart
        incarnation = new_incarnation()
        if s.peer_transport is not None:  # the server reports its L2 (below), not rank 0
            server.call(lambda target: [inst.peer_open(self.name, s.peer_transport.value,
                                                       report_l2=False,
                                                       incarnation=incarnation)
                                        for inst in self._l3_members(target)]
                        ).result(CALL_TIMEOUT_S)
        # its cache events key pages as the namespace does: the directory learns its L2
        server.report_l2(L2Reporter(client, info.namespace, self.name, incarnation))
        if not storage:
            self.directory_only = True
            log.info("instance %s: L3 off, peers found through namespace %s's directory",
                     self.name, info.namespace)
            return ReplicaStorage(self.name, None)
        self.l3 = L3Attachment(kind, info.namespace, dict(options))
        log.info("instance %s: L3 %s attached (namespace %s)", self.name, kind.value,
                 info.namespace)
        return ReplicaStorage(self.name, self.l3)


def instance_snapshot(inst: Instance, name: str) -> InstanceSnapshot:
    """Rank 0's counters and pool use (the ranks of an instance mirror each other), with the
    instance's rank restarts and divergences."""
    snap = inst.cache_snapshot()[0]
    faults = RankFaults(rank_restarts=inst.restarts, rank_divergences=inst.divergences)
    return InstanceSnapshot(name, {**snap.counters, **faults.snapshot()}, snap.storage,
                            snap.host_used_tokens, snap.host_total_tokens, snap.gauges,
                            snap.agreement_s, snap.pins, inst.restarts)
