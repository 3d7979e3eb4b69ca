"""`kvtier demo`: two SmolLM2 instances on a local Ray cluster share a long document's KV.

What it runs (one process drives everything; every instance is TP=3 by default, three rank
actors that agree on hit lengths with one MIN collective per scheduling step; `--tp` takes any
divisor of the model's KV heads; `--model` another model, SGLang's `--hicache-*` flags the
ranks' cache, see kvtier.cli.demo_flags):
  * a local Ray cluster on 127.0.0.1 and the L3 namespace actor with one namespace whose
    storage (`file`: a temp dir; `nixl`: its POSIX plugin in the temp dir; `mooncake`: a
    master the actor starts) every rank opens with its own client;
  * a cold instance without L3: each prompt once with its L1/L2 dropped first, for the
    reference answers and the cold TTFT;
  * instance A answers questions about the document (the first computes it, the next hits
    L1); instance B gets the same document and another question and hits it in L3; A, after
    its L1 is flushed, asks that question again and hits L2.
Every cached answer must equal its cold answer (greedy). The prompts are the document of
`kvtier bench prefix` cut to whole prefill chunks plus a question, so a hit computes only
the question. Each timed request starts with its instance quiescent (copies and backups of
the previous one landed), as in the prefix benchmark.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
import uuid
from typing import Any, NamedTuple

from kvtier.cli import demo_flags
from kvtier.cli.demo_flags import DEFAULT_L3, DEFAULT_MODEL, DEFAULT_PAGE_SIZE, L3_BACKENDS
from kvtier.cli.demo_report import Row, format_table, summary
from kvtier.cli.shared_flags import (DTYPES, add_dtype_flag, add_l3_root_flag,
                                     add_pd_transport_flag, add_tp_flag)
from kvtier.policies import Transport
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

QUESTIONS = ("what did the sensor in room 3 read in record 12?",
             "at what time was record 40 taken?",
             "what did the sensor in room 5 read in record 22?")
# (instance, question index, the tier its document prefix should come from)
PLAN = (("A", 0, "compute"), ("A", 1, "L1"), ("B", 2, "L3"), ("A", 2, "L2"))
# B answers its L3 question this many times, its L1 and L2 dropped before each again; the
# fastest read is its row's (`l3_read_gbps`), as the raw Mooncake baseline keeps its fastest
L3_READ_TRIES = 3


class DemoParams(NamedTuple):
    l3: str = DEFAULT_L3
    tokens: int = 2000  # document tokens, rounded to whole prefill chunks
    new_tokens: int = 24  # greedy tokens per answer
    page_size: int = DEFAULT_PAGE_SIZE
    chunk_tokens: int = 512
    progress: bool = True  # a tqdm bar on stderr
    tp_size: int = 3  # ranks per instance, a divisor of the model's KV heads (SmolLM2: 3)
    address: str | None = None  # join this Ray cluster (None: start a local one)
    l3_root: str = ""  # file/nixl L3 directory ("": a temp dir; on a cluster: a shared mount)
    # instance name -> the node address its ranks must run on (on a cluster)
    nodes: tuple[tuple[str, str], ...] = ()
    dtype: str = "auto"  # of the model and its KV: auto (bf16 where the hardware computes in
    # it, else fp32), bf16 or fp32
    hosts: int = 0  # 3: the whole demo on three hosts of this machine (root; kvtier.hosts)
    model: str = DEFAULT_MODEL  # smollm2, tiny, a Hugging Face model directory or a GGUF file
    # more HiCacheConfig knobs for every rank, by name (SGLang's flags; kvtier.cli.demo_flags)
    hicache: tuple[tuple[str, Any], ...] = ()


class DemoModel(NamedTuple):
    """What the instances run, resolved from `DemoParams.model`."""

    source: Any  # the ranks' WeightSource (kvtier.engine.weight_sources); it pickles
    tokenizer: Any  # kvtier.engine.tokenizer.Tokenizer: the document, questions and answers
    name: str  # the model part of the L3 namespace: what each rank keys its pages with
    label: str  # for messages: SmolLM2-135M-Instruct, kvtier-tiny or the directory's name


HEAD_RESOURCE = "kvtier_head"  # on a cluster the namespace actor runs where this is offered


def _l3_options(backend: str, root: str) -> dict:
    if backend == "mooncake":
        return {}  # the namespace actor starts a master and fills in its address
    return {"root_dir": root}


def demo_model(model: str) -> DemoModel:
    """`model` resolved as `kvtier serve --model` resolves it (kvtier.frontend.settings); its
    namespace name is the one its ranks key pages with (kvtier.actors.rank_actor)."""
    from kvtier.actors.rank_actor import namespace_model
    from kvtier.frontend.served_model import tokenizer, weight_source
    from kvtier.frontend.settings import ServeSettings

    settings = ServeSettings(model=model)
    source = weight_source(settings)
    return DemoModel(source, tokenizer(settings), namespace_model(source),
                     settings.served_model_name)


def _namespace_spec(params: DemoParams, work: "_Workload", root: str):
    """The namespace both instances write and read (a fresh tenant salt per run)."""
    return namespace_spec(work.model.source, work.settings.config, params.l3, root,
                          work.model.name, f"demo-{uuid.uuid4().hex[:8]}",
                          dtype=_torch_dtype(params), page_size=params.page_size,
                          tp_size=params.tp_size, deterministic=work.settings.deterministic,
                          gpu=work.settings.gpu)


def _torch_dtype(params: DemoParams):
    """Resolved here, for the driver's device: the namespace and every rank use the same."""
    from kvtier.dtypes import resolve_here

    return resolve_here(params.dtype)


def namespace_spec(source, config, backend: str, root: str, model: str, tenant_salt: str, *,
                   dtype, page_size: int, tp_size: int = 1, deterministic: bool = False,
                   gpu: bool = False):
    """A NamespaceSpec whose layout fingerprint matches the pages ranks built from `source`
    (a WeightSource), `config`, `dtype` and RankSettings' `deterministic` and `gpu` write;
    `root` holds file/nixl pages. Objects name KV heads, not ranks, so by default the spec is
    the same for every TP size (`tp_size` then only checks that it splits the model's heads)
    and for every L2 layout of `config` (objects are always head-major); deterministic pages
    are keyed by TP size and device too (kvtier.keys.PageCompute)."""
    from kvtier.keys import PageCompute, layout_fingerprint
    from kvtier.kv_spec import KVSpec
    from kvtier.messages import NamespaceSpec

    cfg = source.config()
    if cfg.num_kv_heads % tp_size:
        raise ConfigError(f"{cfg.num_kv_heads} KV heads do not split over TP size {tp_size}")
    spec = KVSpec(num_layers=cfg.full_layers, num_kv_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, page_size=page_size, dtype=dtype,
                  sliding=cfg.sliding_spec())
    compute = PageCompute(deterministic, tp_size, "cuda" if gpu else "cpu")
    fingerprint = layout_fingerprint(spec, cfg.num_kv_heads, compute=compute)
    return NamespaceSpec(model, tenant_salt, fingerprint, backend, _l3_options(backend, root),
                         kv_heads=cfg.num_kv_heads, sliding=spec.sliding is not None)


def run(params: DemoParams = DemoParams()) -> tuple[dict, list[Row]]:
    """Run the demo; the JSON-able summary and one Row per request."""
    _check_params(params)
    model = demo_model(params.model)
    _check_tp(params, model)
    _import_everything()
    t_start = time.perf_counter()
    work = _workload(params, model)
    progress = _Progress(params)
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
            rows, stats, calls = _run_on_local_ray(params, work, tmp, progress)
            progress.done()
    finally:
        progress.close()
    result = summary(params, rows, stats, calls, work.doc_len, work.prompts,
                     time.perf_counter() - t_start)
    if params.model != DEFAULT_MODEL:
        result["model"] = model.name
    if params.hicache:
        result["hicache"] = dict(params.hicache)
    return result, rows


def _check_params(params: DemoParams) -> None:
    if params.l3 not in L3_BACKENDS:
        raise ConfigError(f"--l3 must be one of {', '.join(L3_BACKENDS)}, got {params.l3!r}")
    if params.dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {params.dtype!r}")
    if params.chunk_tokens % params.page_size:
        raise ConfigError(f"--page-size {params.page_size}: the demo prefills in "
                          f"{params.chunk_tokens}-token chunks, so a page size must divide "
                          f"{params.chunk_tokens}; use a power of two up to it")


def _check_tp(params: DemoParams, model: DemoModel) -> None:
    """Each rank holds a whole share of the KV heads."""
    heads = model.source.config().num_kv_heads
    if params.tp_size < 1 or heads % params.tp_size:
        divisors = [str(d) for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(f"--tp must divide the KV heads of {model.label} ({heads}): use "
                          f"{' or '.join(divisors)}; got {params.tp_size}")


def _import_everything() -> None:
    """Import Ray (its env set first), the actors and with them torch and the engine before
    the clock starts, so that `runtime_s` counts the demo's work, not imports."""
    import kvtier.actors.ray_env  # noqa: F401 - sets Ray's env first
    import kvtier.actors.instance  # noqa: F401
    import kvtier.actors.l3.namespace_actor  # noqa: F401
    import kvtier.bench.prefix  # noqa: F401


class _Workload(NamedTuple):
    """The prompts every instance is asked and what each instance's ranks are built from."""

    model: DemoModel
    doc_len: int
    prompts: list  # the document plus each question, token ids
    warmup: list  # token ids that take every instance through one long prefill
    greedy: Any  # kvtier.engine.sampling.SamplingParams
    settings: Any  # kvtier.actors.rank_actor.RankSettings, without L3


def _workload(params: DemoParams, model: DemoModel) -> _Workload:
    from kvtier.bench.prefix import document_tokens
    from kvtier.engine.sampling import SamplingParams

    chunk = params.chunk_tokens
    doc_len = max(chunk, round(params.tokens / chunk) * chunk)
    tok = model.tokenizer
    doc = document_tokens(tok, doc_len)
    prompts = [doc + tok.encode(f"\n\nQuestion: {q} Answer:") for q in QUESTIONS]
    greedy = SamplingParams(max_new_tokens=params.new_tokens, stop_token_ids=tok.stop_token_ids)
    longest = max(len(p) for p in prompts)
    warmup = tok.encode("Warm-up. " * chunk)[: chunk + longest - doc_len]
    return _Workload(model, doc_len, prompts, warmup, greedy,
                     _rank_settings(params, model, longest))


def _rank_settings(params: DemoParams, model: DemoModel, longest: int):
    """Room in L1 for two of the longest requests (prompt, answer and one more chunk)."""
    from kvtier.actors.rank_actor import RankSettings
    from kvtier.engine.request import pages_for

    chunk = params.chunk_tokens
    config = demo_flags.cache_config(params.l3, params.page_size, params.hicache)
    return RankSettings(model.source, config,
                        device_pages=2 * pages_for(longest + params.new_tokens + chunk,
                                                   params.page_size),
                        dtype=_torch_dtype(params), chunk_tokens=chunk,
                        token_budget=max(8192, 2 * longest))


class _Progress:
    """The tqdm bar on stderr (one tick per step) and a log line per stage."""

    def __init__(self, params: DemoParams) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=9 + len(QUESTIONS) + len(PLAN), desc="kvtier demo",
                        unit="step", file=sys.stderr, disable=not params.progress, leave=False)

    def stage(self, name: str) -> None:
        self.bar.set_postfix_str(name)
        log.info("demo: %s", name)

    def done(self) -> None:
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


class _Cluster:
    """What the demo starts on local Ray: the namespace actor's client and the instances.
    `close` stops them, then Ray, whatever was started before a failure."""

    def __init__(self) -> None:
        self.client = None  # kvtier.actors.l3.namespace_actor's client, once created
        self.instances: dict = {}  # name -> kvtier.actors.instance.Instance

    def __enter__(self) -> "_Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        from kvtier.actors.ray_env import shutdown_local_ray

        for inst in self.instances.values():
            inst.close()
        if self.client is not None:
            self.client.shutdown()
        shutdown_local_ray()


def _run_on_local_ray(params: DemoParams, work: _Workload, tmp: str,
                      progress: _Progress) -> tuple[list[Row], dict, dict]:
    """Start Ray, the namespace and the instances; ask every question; stop them all."""
    _start_ray(params, progress)
    with _Cluster() as cluster:
        progress.done()
        actor_name, info = _start_namespace(cluster, params, work, tmp, progress)
        _build_instances(cluster, params, work, actor_name, info, progress)
        _warm_up(cluster.instances, work, progress)
        cold = _cold_runs(cluster.instances["cold"], work, progress)
        rows = _tier_scenarios(cluster.instances, work, cold, progress)
        stats = {n: i.stats() for n, i in cluster.instances.items()}
        calls = {n: (i.call_s, i.num_submitted) for n, i in cluster.instances.items()}
        progress.stage("shutting down")
    return rows, stats, calls


def _start_ray(params: DemoParams, progress: _Progress) -> None:
    from kvtier.actors.rank_actor import RANK_NUM_CPUS
    from kvtier.actors.ray_env import start_local_ray
    from kvtier.actors.ray_join import join_cluster

    if params.address is not None:
        progress.stage(f"joining the Ray cluster at {params.address}")
        join_cluster(params.address)
        return
    progress.stage("starting Ray")
    # Ranks ask for half a CPU each; the machine's cores are shared by whatever runs.
    start_local_ray(num_cpus=max(2, math.ceil(3 * params.tp_size * RANK_NUM_CPUS)))


def _start_namespace(cluster: _Cluster, params: DemoParams, work: _Workload, tmp: str,
                     progress: _Progress) -> tuple[str, Any]:
    """The L3 namespace actor (its name) and the namespace both instances share."""
    from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor

    progress.stage(f"L3 namespace actor ({params.l3})")
    actor_name = f"kvtier-demo-{uuid.uuid4().hex[:8]}"
    on_cluster = params.address is not None
    cluster.client = get_or_create_namespace_actor(
        actor_name, f"{tmp}/state", resources={HEAD_RESOURCE: 1} if on_cluster else None)
    root = params.l3_root or f"{tmp}/l3"
    info = cluster.client.register(_namespace_spec(params, work, root))
    progress.done()
    return actor_name, info


def _build_instances(cluster: _Cluster, params: DemoParams, work: _Workload, actor_name: str,
                     info: Any, progress: _Progress) -> None:
    """The cold reference without L3, then A and B on the shared namespace."""
    from kvtier.actors.instance import Instance

    nodes = dict(params.nodes)
    for name, l3 in (("cold", None), ("A", info), ("B", info)):
        where = f" on {nodes[name]}" if name in nodes else ""
        progress.stage(f"instance {name}{where}")
        resources = {f"node:{nodes[name]}": 0.01} if name in nodes else None
        cluster.instances[name] = Instance(work.settings._replace(l3=l3, l3_actor=actor_name),
                                           tp_size=params.tp_size, resources=resources)
        progress.done()


def _warm_up(instances: dict, work: _Workload, progress: _Progress) -> None:
    for name, inst in instances.items():
        progress.stage(f"warm-up {name}")
        inst.generate([work.warmup], work.greedy)
        inst.quiesce()
        progress.done()


def _cold_runs(cold: Any, work: _Workload, progress: _Progress) -> list:
    """Each prompt once on the cold instance, its L1/L2 dropped first: the reference Outputs."""
    outs = []
    for i, prompt in enumerate(work.prompts):
        progress.stage(f"cold run of question {i + 1}")
        cold.drop_cache()
        cold.quiesce()
        outs.append(cold.generate([prompt], work.greedy)[0])
        progress.done()
    return outs


def _tier_scenarios(instances: dict, work: _Workload, cold: list,
                    progress: _Progress) -> list[Row]:
    """Each request of PLAN, set up so its document prefix comes from the tier it names."""
    rows = []
    for name, q, expected in PLAN:
        progress.stage(f"{name}: question {q + 1} (expect {expected})")
        inst = instances[name]
        if expected == "L3":
            instances["A"].quiesce()  # A's L2 -> L3 backups have landed
        if expected == "L2":
            inst.evict_device()
        inst.quiesce()
        out, read = _answer_reading_l3(inst, work.prompts[q], work)
        again, tries = [], [read]
        if expected == "L3" and read is not None:
            for _ in range(L3_READ_TRIES - 1):
                inst.drop_cache()
                inst.quiesce()
                out_again, read_again = _answer_reading_l3(inst, work.prompts[q], work)
                again.append(out_again)
                tries.append(read_again)
        fastest = min((t for t in tries if t), key=lambda t: t[1], default=None)
        text = work.model.tokenizer.decode(out.tokens)
        rows.append(Row(name, q + 1, expected, out, cold[q], text, fastest, tuple(again),
                        tuple(t[1] for t in tries if t) if again else ()))
        progress.done()
    return rows


def _answer_reading_l3(inst: Any, prompt: list, work: _Workload
                       ) -> tuple[Any, tuple[int, float] | None]:
    """`inst`'s answer to `prompt`, and the L3 bytes its ranks read for it with the longest
    time a rank spent reading them (None: no L3, or nothing read)."""
    before = _l3_reads(inst)
    out = inst.generate([prompt], work.greedy)[0]
    after = _l3_reads(inst)
    if before is None or after is None:
        return out, None
    read = (sum(b for b, _ in after) - sum(b for b, _ in before),
            max(a[1] - b[1] for a, b in zip(after, before)))
    return out, read if read[0] else None


def _l3_reads(inst: Any) -> list[tuple[int, float]] | None:
    """(bytes read, seconds reading) of each rank's L3 client; None without an L3."""
    snaps = [snap.storage for snap in inst.cache_snapshot()]
    if any(s is None for s in snaps):
        return None
    return [(s["bytes_read"], s["read_s"]) for s in snaps]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=2000,
                   help="document length, rounded to whole 512-token chunks (default 2000)")
    p.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per answer")
    add_tp_flag(p, None, "default 3; SmolLM2-135M has 3 KV heads: 1 or 3; 1 with --engine "
                         "vllm")
    add_dtype_flag(p)
    p.add_argument("--json-only", action="store_true",
                   help="print only the final JSON line (no table, no progress bar)")
    g = p.add_argument_group("several hosts")
    g.add_argument("--hosts", type=int, default=0,
                   help="3: run on three hosts made on this machine (root; network "
                        "namespaces): head and L3 on host 1, A on host 2, B on host 3")
    g.add_argument("--address", default=None,
                   help="join this Ray cluster (e.g. auto) instead of starting a local one; "
                        "the L3 namespace actor needs a node offering kvtier_head")
    add_l3_root_flag(g, "; on a cluster, one mounted on every node")
    g.add_argument("--place", action="append", default=[], metavar="NAME=ADDRESS",
                   help="run instance NAME (cold, A or B) on the node with this address")
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--pd", action="store_true",
                   help="answer through a prefill and a decode instance (KV handed over), "
                        "each answer checked against a mixed instance's")
    add_pd_transport_flag(g, Transport.NIXL.value, "; with --pd")
    p.add_argument("--engine", choices=("kvtier", "vllm"), default="kvtier",
                   help="vllm: the same story with two vLLM engines whose L2 and L3 are "
                        "kvtier's (KvtierConnector; SmolLM2, TP 1, file L3; docs/vllm.md)")
    demo_flags.add_arguments(p)  # --l3, --model and SGLang's --hicache-* flags


def params_from(ns: argparse.Namespace) -> DemoParams:
    nodes = []
    for item in ns.place:
        name, sep, address = item.partition("=")
        if not sep or name not in ("cold", "A", "B") or not address:
            raise ConfigError(f"--place takes NAME=ADDRESS with NAME cold, A or B; got {item!r}")
        nodes.append((name, address))
    cache = demo_flags.cache_from_args(ns, ns.l3_root)  # l3, l3_root, page_size, hicache
    return DemoParams(tokens=ns.tokens, new_tokens=ns.new_tokens, progress=not ns.json_only,
                      tp_size=3 if ns.tp is None else ns.tp, address=ns.address,
                      nodes=tuple(nodes), dtype=ns.dtype, hosts=ns.hosts, model=ns.model,
                      **cache._asdict())


def main(ns: argparse.Namespace) -> int:
    params = params_from(ns)
    _check_params(params)
    if ns.engine == "vllm":
        from kvtier.cli import demo_vllm

        if ns.pd:
            raise ConfigError("--engine vllm has no prefill/decode demo; drop --pd")
        demo_vllm.check(params, tp_given=ns.tp is not None)
        return demo_vllm.main(params._replace(tp_size=1), ns.json_only)
    if ns.pd:
        if params.hosts or params.address:
            raise ConfigError("--pd runs on local Ray only; drop --hosts/--address")
        from kvtier.cli.demo_pd import main as main_pd

        return main_pd(params, ns.pd_transport, ns.json_only)
    if params.hosts:
        from kvtier.cli.demo_hosts import main as main_on_hosts

        return main_on_hosts(params)
    result, rows = run(params)
    if not ns.json_only:
        print(format_table(rows))
        print("questions: " + " | ".join(f"q{i + 1}: {q}" for i, q in enumerate(QUESTIONS)))
        for r in rows:
            print(f"{r.instance} q{r.question} answer: {r.text!r}")
    print(json.dumps(result))
    return 0 if result["identical"] else 1
