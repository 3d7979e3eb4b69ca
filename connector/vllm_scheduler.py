"""`KvtierScheduler`: vLLM's scheduler with hit-first admission (kvtier.connector.admission):
before each step it puts the waiting request with the most cached tokens (vLLM's prefix
cache, then KvtierConnector's L2) first in line, preempting cold prefills whose computed
pages L2 already holds when it needs their blocks or token budget (and keeping those pages
in L2 until the victim is admitted again), until some request has waited `max_wait_steps`
steps (aging: the oldest goes first). Everything else is vLLM's `Scheduler`.

The serve graph's vLLM instances run it; with `vllm serve` load it beside the connector
with `--scheduler-cls kvtier.connector.vllm_scheduler.KvtierScheduler` (docs/vllm.md). vLLM
runs a custom scheduler without async scheduling (its CPU build never schedules async). It
acts only under the first-come-first-served policy (under `--scheduling-policy priority`
the priorities decide) and only on requests the connector can see; without the connector
it orders by vLLM's prefix cache alone and never preempts what L2 does not hold.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvtier.connector.admission import (RunningRequest, WaitingRequest, admit, blocks_for,
                                        is_hit)
from kvtier.connector.vllm_connector import KvtierConnector, skips_reading
from kvtier.engine.queue_order import DEFAULT_MAX_WAIT_STEPS

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

MAX_CANDIDATES = 64  # waiting requests looked at per step, from the head of the queue


class KvtierScheduler(Scheduler):
    """vLLM's scheduler, hit-first (module docstring)."""

    max_wait_steps = DEFAULT_MAX_WAIT_STEPS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._waiting_since: dict[str, int] = {}  # request id -> step first seen waiting

    def schedule(self, throttle_prefills: bool = False) -> "SchedulerOutput":
        if (self.policy == SchedulingPolicy.FCFS and self._pause_state == PauseState.UNPAUSED
                and len(self.waiting)):
            self._admit_hits_first()
        return super().schedule(throttle_prefills)

    def _admit_hits_first(self) -> None:
        queue = list(self.waiting)
        # the step each waiting request was first seen waiting (aging), kept while it waits
        self._waiting_since = {r.request_id: self._waiting_since.get(r.request_id,
                                                                     self.current_step)
                               for r in queue}
        oldest_id = min(self._waiting_since, key=self._waiting_since.__getitem__)
        waited = self.current_step - self._waiting_since[oldest_id]
        waiting = []
        for request in queue[:MAX_CANDIDATES]:
            if request.status == RequestStatus.WAITING and request.num_computed_tokens == 0:
                waiting.append(self._waiting(request))
        aged = waited >= self.max_wait_steps
        if not aged and not any(is_hit(w, self.block_size) for w in waiting):
            return  # nothing to put first: spare the running requests' L2 lookups
        manager = self.kv_cache_manager
        running = [] if aged else [self._running(r) for r in self.running]
        admission = admit(waiting, running, manager.block_pool.get_num_free_blocks(),
                          self.max_num_scheduled_tokens, self.block_size, waited,
                          self.max_wait_steps, oldest_id)
        now = time.monotonic()
        for req_id in admission.preempt:
            victim = self.requests[req_id]
            self.running.remove(victim)
            self._preempt_request(victim, now, drop_stale_output=self.requires_kv_delivery)
            if isinstance(self.connector, KvtierConnector):  # its L2 pages wait for it
                self.connector.keep_for(victim)
        if admission.first is not None:
            first = self.requests[admission.first]
            if self.waiting.peek_request() is not first:
                self.waiting.remove_request(first)
                self.waiting.prepend_request(first)

    def _waiting(self, request: "Request") -> WaitingRequest:
        manager = self.kv_cache_manager
        local, shared = 0, frozenset()
        if manager.prefix_cache_lookup_enabled(request):
            blocks, local, _ = manager.coordinator.find_longest_cache_hit(
                request.block_hashes, request.num_tokens - 1)
            shared = frozenset(block.block_id for block in blocks[0] if block.ref_cnt > 0)
        local -= local % self.block_size
        cached = local + self._held(request, local)
        return WaitingRequest(request.request_id, request.num_tokens, cached,
                              blocks_for(request.num_tokens, self.block_size) - len(shared),
                              shared)

    def _running(self, request: "Request") -> RunningRequest:
        blocks = self.kv_cache_manager.get_blocks(request.request_id).blocks[0]
        prefilling = request.num_computed_tokens < request.num_prompt_tokens
        return RunningRequest(
            request.request_id, request.num_prompt_tokens, request.num_computed_tokens,
            saved=self._held(request, 0) if prefilling else 0,
            freeable=frozenset(block.block_id for block in blocks if block.ref_cnt == 1),
            preempted_before=request.num_preemptions > 0,
            can_free=self._request_blocks_can_be_freed(request))

    def _held(self, request: "Request", local_tokens: int) -> int:
        connector = self.connector
        if not isinstance(connector, KvtierConnector) or skips_reading(request):
            return 0
        return connector.held_tokens(request, local_tokens)
