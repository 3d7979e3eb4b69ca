"""The vLLM engines of a `kvtier bench chaos --engine vllm` graph, through Ray: every Ray call
of its vLLM faults (the others are actors/chaos_faults.py's).

- `processes`: an instance's EngineCore and worker pids (its replica walks its own process
  tree: VllmDeployment.engine_processes); the drill signals them from this machine.
- `ask`: a probe request sent to one instance directly, past the router, so a drill knows
  which instance computes a document and which one reads it back (from L3 or from the first
  one's L2): a greedy answer, its tokens and cached tokens by tier.
- `published` / `lent`: how many of a probe's pages the L3 directory lists as stored, or as
  held in an instance's L2 (what a reader would fetch).
- `audits` and `leases_active`: after the traffic, what each engine still holds with no
  request running (VllmInstance.audit) and the L3 leases still open in the directory (a
  lookup's lease is released once its fetch ends).
"""
from __future__ import annotations

import logging
import threading
from typing import NamedTuple, Sequence

import ray

from kvtier.actors.chaos_faults import RankTarget, rank_targets
from kvtier.actors.l3.namespace_actor import RAY_NAMESPACE, NamespaceClient, NamespaceUnavailable
from kvtier.actors.serve_graph import APP_NAME
from kvtier.actors.step_wire import encode_sampling
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.request import CachedTokens
from kvtier.errors import KvtierError
from kvtier.frontend.records import AnswerItem, AnswerItemKind
from kvtier.frontend.settings import ServeSettings
from kvtier.messages import unpack_record

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0


class Probe(NamedTuple):
    """A probe's answer: its tokens, the prompt tokens it reused by tier (None when it
    failed), and why it failed ("" when answered)."""

    tokens: tuple[int, ...]
    cached: CachedTokens | None
    error: str = ""


class EngineChaos:
    """The vLLM instances of the graph of `settings` (app `serve_graph.APP_NAME`)."""

    def __init__(self, settings: ServeSettings, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.settings, self.call_timeout_s = settings, call_timeout_s
        self.targets = rank_targets(settings)

    def _handle(self, target: RankTarget):
        from ray import serve

        if not ray.is_initialized():
            raise KvtierError("Ray is not running in this process: the chaos graph has stopped")
        return serve.get_deployment_handle(target.deployment, app_name=APP_NAME)

    def processes(self, target: RankTarget, timeout_s: float | None = None):
        """`target`'s EngineProcesses (vllm_engine/processes.py)."""
        from kvtier.vllm_engine.processes import EngineProcesses

        raw = self._handle(target).engine_processes.remote().result(
            timeout_s=self.call_timeout_s if timeout_s is None else timeout_s)
        return unpack_record(EngineProcesses, raw)

    def ask(self, target: RankTarget, tokens: Sequence[int], max_tokens: int,
            timeout_s: float) -> Probe:
        """A greedy answer of `tokens` from `target` (eos ignored), cancelled after
        `timeout_s`; its failure is a value."""
        sampling = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=())
        stream = self._handle(target).options(stream=True).generate.remote(
            list(tokens), encode_sampling(sampling), "", None)
        timer = threading.Timer(timeout_s, stream.cancel)
        timer.start()
        got: list[int] = []
        try:
            for raw in stream:
                item = AnswerItem.from_msgpack(raw)
                got += item.tokens
                if item.kind is AnswerItemKind.FINAL:
                    return Probe(tuple(got), item.final.cached)
                if item.kind is AnswerItemKind.ERROR:
                    return Probe(tuple(got), None, item.error)
            return Probe(tuple(got), None, "the answer ended without its last item")
        except Exception as exc:  # noqa: BLE001 - a probe that failed is a record
            return Probe(tuple(got), None, f"{type(exc).__name__}: {exc}"[:500])
        finally:
            timer.cancel()

    def audits(self) -> dict[str, object]:
        """Each instance's EngineAudit (vllm_engine/instance.py), by name."""
        from kvtier.vllm_engine.instance import EngineAudit

        return {t.name: unpack_record(EngineAudit, self._handle(t).engine_audit.remote().result(
            timeout_s=self.call_timeout_s)) for t in self.targets}

    # ---- the L3 namespace's directory -----------------------------------------------------
    def _directory(self) -> NamespaceClient | None:
        try:
            handle = ray.get_actor(self.settings.l3_actor, namespace=RAY_NAMESPACE)
        except ValueError:  # no namespace actor (yet)
            return None
        return NamespaceClient(handle)

    def leases_active(self) -> int:
        """Leases the directory holds open in every namespace (0 without the actor)."""
        client = self._directory()
        if client is None:
            return 0
        return sum(client.stats(ns).leases_active for ns in client.namespaces())

    def published(self, tokens: Sequence[int]) -> int:
        """Leading pages of `tokens` (no salt) the directory lists as stored in L3."""
        return max(self._per_namespace(tokens, lambda c, ns, keys: c.lookup(ns, keys).hit_pages),
                   default=0)

    def lent(self, tokens: Sequence[int], holder: str) -> int:
        """Leading pages of `tokens` (no salt) the directory lists in `holder`'s L2."""
        def pages(client: NamespaceClient, ns: str, keys: list[str]) -> int:
            return max((h.pages for h in client.l2_holders(ns, keys) if h.holder == holder),
                       default=0)

        return max(self._per_namespace(tokens, pages), default=0)

    def _per_namespace(self, tokens: Sequence[int], fn) -> list[int]:
        client = self._directory()
        if client is None:
            return []
        out = []
        try:
            for ns in client.namespaces():
                keys = client.info(ns).spec.key_namespace.page_hashes(list(tokens),
                                                                      self.settings.page_size)
                out.append(fn(client, ns, keys))
        except NamespaceUnavailable as exc:  # restarting: nothing listed now
            log.info("the namespace actor cannot answer now: %s", exc)
        return out
