"""One local Ray cluster and Serve for the serve tests that deploy the graph (test_http_fuzz,
test_serve_app, test_serve_stall): starting them is most of each module's setup. Each module
deploys its own graph on it with `served(settings)` and deletes it afterwards; conftest stops
the cluster when the tests leave tests/serve."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from kvtier.actors import serve_graph
from kvtier.actors.rank_actor import Rank
from kvtier.netcheck import descendants
from kvtier.frontend.settings import ServeSettings

PORT = 8131
BASE = f"http://127.0.0.1:{PORT}"
_before: list[set[int]] = []  # this process's children before the cluster started


@contextlib.contextmanager
def served(settings: ServeSettings, rank_class: type[Rank] = Rank
           ) -> Iterator[set[int]]:
    """The graph of `settings` on the shared cluster (started by the first); yields every
    process the cluster has started (Ray's, Serve's, the replicas, the ranks)."""
    import ray

    if _before and ray.cluster_resources().get("CPU", 0) < settings.rank_cpus + 1:
        stop()  # started for smaller settings
    if _before:
        serve_graph.deploy(settings, rank_class)
    else:
        _before.append(descendants(os.getpid()))
        try:
            serve_graph.start(settings, port=PORT, rank_class=rank_class)
        except BaseException:
            stop()
            raise
    try:
        yield descendants(os.getpid()) - _before[0]
    finally:
        _delete(settings)


def _delete(settings: ServeSettings) -> None:
    """The app and the namespace actor it created (detached: it would outlive the app, with
    this app's L3 root)."""
    import ray
    from ray import serve

    from kvtier.actors.l3.namespace_actor import RAY_NAMESPACE, NamespaceClient

    serve.delete(serve_graph.APP_NAME)
    try:
        handle = ray.get_actor(settings.l3_actor, namespace=RAY_NAMESPACE)
    except ValueError:  # no L3, or never attached
        return
    NamespaceClient(handle).shutdown()


def stop() -> None:
    """Serve and the cluster, if running."""
    if _before:
        _before.clear()
        serve_graph.stop()


def greedy_chat(model: str, messages: list[dict], max_tokens: int) -> dict:
    """A greedy chat completion of exactly `max_tokens` tokens (eos ignored): its JSON body."""
    from http_client import ServeClient

    return ServeClient(BASE, model).chat(messages, max_tokens, ignore_eos=True)


def in_process_answer(source, tok, prompt: list[int], max_tokens: int) -> str:
    """What `source`'s model (fp32, one Engine in this process) answers `prompt`, greedy. On
    one thread, as every rank runs: a matmul's last bits depend on how its sums are split,
    and a near-tie between two tokens may go either way otherwise."""
    import torch

    from cache_builder import build_cache

    from kvtier.engine import Engine, SamplingParams, build_model

    model = build_model(source.config(), source.state_dict(), torch.float32, "cpu")
    cache = build_cache(model.kv_spec(16), 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Engine(model, cache, tokenizer=tok, owns_cache=True) as engine:
            (cold,) = engine.generate([prompt], SamplingParams(max_new_tokens=max_tokens,
                                                               stop_token_ids=()))
    finally:
        torch.set_num_threads(threads)
    return tok.decode(cold.tokens)
