"""Waking what waits on a vLLM engine that died.

vLLM's synchronous client (SyncMPClient, vLLM 0.32) marks its engine dead when the EngineCore
process exits (a worker's death takes the EngineCore down with it), and its calls made after
that raise EngineDeadError. A call already waiting does not: a step waiting for the engine's
outputs, or a utility call (`reset_prefix_cache`) waiting for its answer, waits forever, since
the client's output thread stops without a word. The instance's driver thread would then
hang in its step, its replica would answer health checks, and its requests would stay until
the router moved them: an instance stalled for good instead of replaced (docs/vllm.md).

`EngineWatch` looks at the client's dead mark twice a second and, once it is set, hands
EngineDeadError to whatever waits, so the step raises, the instance stops serving and its
replica fails its health check.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

INTERVAL_S = 0.5


class EngineWatch:
    """Watches `client` (an LLMEngine's `engine_core`) until it dies or `close()`; a client
    without an engine process of its own (in-process) is not watched."""

    def __init__(self, client: Any, interval_s: float = INTERVAL_S) -> None:
        self._client, self._interval_s = client, interval_s
        self._stop = threading.Event()
        watchable = all(hasattr(client, name) for name in
                        ("resources", "outputs_queue", "utility_results"))
        self._thread = None
        if watchable:
            self._thread = threading.Thread(target=self._run, name="kvtier-engine-watch",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            if getattr(self._client.resources, "engine_dead", False):
                self._wake()
                return

    def _wake(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        log.error("the vLLM engine died; failing the calls that wait on it")
        self._client.outputs_queue.put_nowait(EngineDeadError())
        for future in list(self._client.utility_results.values()):
            try:
                future.set_exception(EngineDeadError())
            except (concurrent.futures.InvalidStateError, RuntimeError):
                pass  # answered meanwhile

    def close(self) -> None:
        self._stop.set()
