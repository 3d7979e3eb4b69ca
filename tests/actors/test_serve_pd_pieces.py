"""The prefill/decode deployment's driver thread without a cluster: `InstanceServer` drives a
PD driver through `PDInstances` as it drives an Instance: each request's output so far as it
grows, then its PDOutput; a cancelled request is aborted in the driver."""
from __future__ import annotations

import threading

from kvtier.actors.instance_server import InstanceServer, ServerEvent, ServerEventKind
from kvtier.actors.pd.deployment import PDDeployment, PDInstances, member_names
from kvtier.actors.pd.driver import PDMode, PDOutput, PDStep
from kvtier.actors.step_wire import Progress
from kvtier.engine.handoff import HandoffStages
from kvtier.engine.request import CachedTokens, FinishReason
from kvtier.engine.sampling import SamplingParams
from kvtier.frontend.openai_responses import pd_report
from kvtier.frontend.records import AnswerItem, AnswerItemKind
from kvtier.frontend.settings import ServeSettings
from kvtier.tiers.cache_types import RequestLengths


class FakeDriver:
    """Answers each request with 7, 8, 9, ... one token per step."""

    prefill: list = []
    decode: list = []
    restarts = 0

    def __init__(self) -> None:
        self.running: dict[int, tuple[int, list[int]]] = {}  # id -> (prompt length, tokens)
        self.aborted: list[int] = []
        self.closed = False
        self._next = 0

    def add(self, tokens, sampling: SamplingParams, cache_salt: str = "", resume=None,
            request_id: int | None = None, label: str = "") -> int:
        self._next += 1
        rid = self._next if request_id is None else request_id
        self.running[rid] = (sampling.max_new_tokens, [])
        return rid

    def abort(self, request_id: int) -> bool:
        self.aborted.append(request_id)
        return self.running.pop(request_id, None) is not None

    def step_report(self) -> PDStep:
        finished, progress = [], {}
        for rid, (most, out) in list(self.running.items()):
            out.append(7 + len(out))
            if len(out) < most:
                progress[rid] = Progress(len(out) - 1, tuple(out[-1:]))
                continue
            del self.running[rid]
            finished.append(PDOutput(rid, (1, 2), tuple(out), FinishReason.LENGTH,
                                     PDMode.HANDOFF, HandoffStages(0.1, 0.2, 0.3, 0.4, 0.5),
                                     0.3, CachedTokens(0, 0, 0), RequestLengths(0, 0, 0, 0, 2),
                                     4096, 0, 0, transfer_pages=1))
        return PDStep(finished, progress)

    @property
    def num_pending(self) -> int:
        return len(self.running)

    def close(self) -> None:
        self.closed = True


def test_the_server_streams_a_pd_request_and_aborts_a_cancelled_one():
    driver = FakeDriver()
    server = InstanceServer(PDInstances(driver), "pd")
    items, done = [], threading.Event()

    def sink(event: ServerEvent):
        items.append(event)
        if event.kind is not ServerEventKind.TOKENS:
            done.set()

    try:
        server.submit([1, 2], SamplingParams(max_new_tokens=3), sink)
        assert done.wait(10), items
        assert [(e.progress.start, e.progress.tokens) for e in items[:-1]] == [(0, (7,)),
                                                                               (1, (8,))]
        last = items[-1]
        assert last.kind is ServerEventKind.DONE and last.output.tokens == (7, 8, 9)
        assert last.output.mode is PDMode.HANDOFF
        key = server.submit([1, 2], SamplingParams(max_new_tokens=10_000), lambda _: None)
        server.cancel(key)
        for _ in range(200):
            if driver.aborted:
                break
            threading.Event().wait(0.01)
        assert driver.aborted == [2] and not driver.running
        assert server.poll().load == 0
    finally:
        server.close()
    assert driver.closed


def test_the_instances_are_named_by_role():
    s = ServeSettings(model="tiny", prefill_instances=2, decode_instances=1)
    assert member_names(s) == ["prefill-0", "prefill-1", "decode-0"]


def test_a_pd_answers_last_item_says_how_it_went_in_a_record():
    """The final item's `pd` report comes back from its msgpack trip as `pd_report` made it
    (the `kvtier.pd` JSON a client reads), with the prefill and decode instances' names."""
    deployment = object.__new__(PDDeployment.func_or_class)
    deployment.name = "pd"
    deployment.settings = ServeSettings(model="tiny", prefill_instances=1, decode_instances=1)
    deployment.names = member_names(deployment.settings)
    stages = HandoffStages(0.1, 0.2, None, 0.4, 0.5)
    out = PDOutput(1, (1, 2), (7, 8), FinishReason.LENGTH, PDMode.HANDOFF, stages, 0.3,
                   CachedTokens(0, 0, 0), RequestLengths(0, 0, 0, 0, 2), 4096, 0, 0,
                   transfer_pages=1)
    final = deployment._final(out)
    item = AnswerItem.from_msgpack(
        AnswerItem(AnswerItemKind.FINAL, (8,), final=final).to_msgpack())
    expected = pd_report("handoff", deployment.settings.pd_transport.value, "prefill-0",
                         "decode-0", stages, 4096, 1)
    assert list(item.final.pd.to_dict().items()) == list(expected.to_dict().items())
    assert item.final.instance == "pd" and item.final.finish_reason is FinishReason.LENGTH
