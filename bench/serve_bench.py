"""`kvtier bench serve`: a multi-turn chat load over HTTP, against the serve graph with the
cache on and (`--compare-off`) off, or against any OpenAI-compatible server (`--base-url`).

    kvtier bench serve --json                       # cache on: L1 + L2 + file L3
    kvtier bench serve --compare-off --json         # then the same load with L1 only
    kvtier bench serve --base-url http://127.0.0.1:8000 --json    # a server already running
    kvtier bench serve --engine vllm --compare-off --json   # vLLM instances; and vLLM alone

Without `--base-url` each run starts the app on a new local Ray cluster
(`actors.serve_graph.start`), drives `serve_load` against http://127.0.0.1:<port> and stops
it (in a `finally`). `--compare-off` runs the same load (same seed, same L1 size) against
`enable_hierarchical_cache=False` and prints `serve_load.compare(on, off)`: the on figures at the top
level, the off ones under "off", and `round2_ttft_ratio` (round-2 mean TTFT on / off).
With `--engine vllm` the app's instance is a vLLM engine with KvtierConnector and hit-first
admission (kvtier.connector.vllm_scheduler), the off run the same engine without the
connector, and the same load then goes to vLLM's own OpenAI server with the same engine
settings (`serve_vllm_alone`): `vllm_alone` holds its figures,
`round2_vs_vllm_alone` the round-2 mean TTFT on / vLLM alone.

With `--base-url` nothing starts: the same load (the bench's clients, rounds, words, answer
tokens, seed and rate) goes to that server as it was started (vLLM, SGLang, kvtier on another
machine). The flags that configure kvtier's own app (`AppFlag`: --compare-off, --instances,
--model, --device-pages, --chunk-tokens, --port) are refused with it: they would not change
the server, and a cache-off baseline there is a second run against that server started with
its cache off. `--served-model-name` is what the requests name (default: the first model
`GET /v1/models` lists).

Cached tokens come from `usage.prompt_tokens_details.cached_tokens` (kvtier always sends it;
vLLM with `--enable-prompt-tokens-details`, SGLang with `--enable-cache-report`). When an
answer lacks it, the JSON says `cached_tokens_reported: false` and the cached figures and
hit rates are null, not 0. By tier (`cached_tokens`) comes only from kvtier's own `kvtier`
usage field. `hit_rate_after_round1` is cached prompt tokens / prompt tokens over rounds 2
and later: the share of the resent history the server reused.

The engine and cache settings are `kvtier serve`'s defaults (`ServeSettings`), the prefill
chunk included (512 tokens), so the figures are what a default deployment gives: a hit is
reused down to any page and an answer's pages are cached, so a follow-up reuses its whole
history but the last partial page. `--deterministic` runs kvtier serve's bit-identical mode
(one-page chunks, prompt pages only), which reuses less.

The default load: each conversation is about a document (a 1,000-word first turn, about
1,070 tokens with the chat template), then 30-word questions, 16-token answers, 3 rounds, 4
clients starting at once (`--rate 0`). Round r+1 resends round r's prompt and answer, so
from round 2 on about 90% of a prompt is a prefix the server computed before; how much of it
the server reuses is `hit_rate_after_round1`.

Why the default L1 is small. The comparison is about a history that L1 could not keep: with
the cache on it comes back from L2 (a copy), with it off it is recomputed (a prefill). So the
histories must NOT all fit in L1: `--device-pages` defaults to two conversations' worth
(`default_device_pages`, from the load's shape: 40 pages of 64 tokens here, against 80 for
all four), never below the smallest L1 that admits the last round. L2 (hicache_ratio 4)
holds every history. One instance by default: on two cores a second one only competes for
the same CPUs.

What bounds the ratio here. A round-2 request computes only the part of its prompt it does
not reuse (its new question), but it waits for L1 room and budget behind the other clients'
requests (longest cached prefix first, with aging), so round-2 TTFT with the cache on is
partly queueing on this 2-core machine; measured ratios are in docs and the closing notes,
not asserted anywhere.

The server's `max_new_tokens` is set to `--max-tokens` (every request asks exactly that), so
it does not eat L1 room the load never uses. With `--json`, whatever Ray prints on stdout
while the app runs goes to stderr: stdout carries the one JSON line only.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import shutil
import sys
import tempfile
import urllib.parse
from typing import Any, Iterator

from kvtier.bench import emit, stdout_to_stderr
from kvtier.bench.serve_load import LoadParams, LoadResult, compare, round_ratio, run_load_sync
from kvtier.config import HiCacheConfig
from kvtier.errors import ConfigError
from kvtier.cli.flags import add_hicache_flags, config_from_args
from kvtier.cli.shared_flags import add_dtype_flag, add_model_flag, add_schedule_policy_flag
from kvtier.policies import StorageBackendKind
from kvtier.frontend.settings import HICACHE_OWNED, EngineKind, ServeSettings
from kvtier.storage_options import EXTRA_CONFIG_FLAG

LOOPBACK = "127.0.0.1"
SERVE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServeSettings)}
PAGE_SIZE = SERVE_DEFAULTS["page_size"]
CHUNK_TOKENS = SERVE_DEFAULTS["chunk_tokens"]
# SGLang's cache flags the bench sets itself (its L1 sizing is in 64-token pages; L3 is a
# file directory of its own; --compare-off runs the cache off): refused, with what to do.
OWN_CACHE_FLAGS = {
    "page_size": f"--page-size: the bench sizes L1 in {PAGE_SIZE}-token pages; drop it",
    "storage_backend": "--hicache-storage-backend: the bench's L3 is a file directory of its "
                       "own; drop it",
    "storage_options": f"{EXTRA_CONFIG_FLAG}: the bench's L3 is a file directory of its own; "
                       "drop it",
    "enable_hierarchical_cache": "--enable/--disable-hierarchical-cache: the bench runs the "
                                 "cache on, and off as well with --compare-off; drop it",
    "disable_radix_cache": "--disable-radix-cache: the bench measures prefix reuse; drop it",
}
# Prompt-size estimate for the synthetic chat (SmolLM2 chat template, measured with its
# tokenizer): the default system prompt and the first turn's header, then per round the
# words (about 1.02 tokens each: a few words split in two) and the turn's template tokens.
TEMPLATE_BASE_TOKENS = 48
TOKENS_PER_WORD = 1.05
TEMPLATE_TURN_TOKENS = 12


class AppFlag(argparse.Action):
    """Stores the flag's value (True for a switch, `nargs=0`) and notes the flag in
    `ns.app_flags`: it configures kvtier's own app, which --base-url does not start."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        namespace.app_flags = (*namespace.app_flags, option_string)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.set_defaults(app_flags=())
    p.add_argument("--json", action="store_true", help="print one JSON object (no progress bar)")
    p.add_argument("--base-url", default=None,
                   help="send the load to this OpenAI-compatible server (http://host:port, "
                        "with or without /v1) instead of starting kvtier's app")
    p.add_argument("--served-model-name", default=None,
                   help="the model the requests name (default: the first model the server "
                        "lists); without --base-url also the name kvtier's app serves")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (a server started with an API key)")
    p.add_argument("--clients", type=int, default=4, help="conversations (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per conversation (default 3)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="client starts per second, Poisson; 0 = all at once (default 0)")
    p.add_argument("--turn-tokens", type=int, default=30,
                   help="words per later user turn, about one token each (default 30)")
    p.add_argument("--first-turn-tokens", type=int, default=1000,
                   help="words of each conversation's first turn, a document it is about "
                        "(default 1000; 0: --turn-tokens)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument("--seed", type=int, default=0, help="the synthetic text and arrivals")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds for each run's load, requests in flight included (default 600)")
    app = p.add_argument_group("kvtier's own app (not with --base-url)")
    app.add_argument("--instances", type=int, default=1, action=AppFlag,
                     help="model instances (default 1)")
    add_model_flag(app, SERVE_DEFAULTS["model"].value, note=", as kvtier serve", action=AppFlag)
    app.add_argument("--device-pages", type=int, default=None, action=AppFlag,
                     help=f"L1 pages per rank, page size {PAGE_SIZE} (default: two "
                          "conversations' histories, so they do not all fit)")
    app.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS, action=AppFlag,
                     help=f"most new tokens per forward, a multiple of {PAGE_SIZE} "
                          f"(default {CHUNK_TOKENS}, as kvtier serve)")
    add_dtype_flag(app, SERVE_DEFAULTS["dtype"].value, note=", as kvtier serve",
                   action=AppFlag)
    app.add_argument("--deterministic", nargs=0, default=False, action=AppFlag,
                     help="answers bit-identical to a cold run (as kvtier serve --deterministic)")
    add_schedule_policy_flag(app, SERVE_DEFAULTS["schedule_policy"].value, ", as kvtier serve",
                             action=AppFlag)
    app.add_argument("--engine", choices=[e.value for e in EngineKind],
                     default=EngineKind.KVTIER.value, action=AppFlag,
                     help="what the app's instance runs (as kvtier serve --engine); with vllm "
                          "and --compare-off the same load also goes to vLLM's own server "
                          "(prefix caching on, no connector), started by the bench")
    app.add_argument("--compare-off", nargs=0, default=False, action=AppFlag,
                     help="then run the same load with the cache off (L1 only, same L1 size)")
    app.add_argument("--check-cold", nargs=0, default=False, action=AppFlag,
                     help="then replay every answered request alone and cold in this process "
                          "(deterministic mode) and report how many answers equal it "
                          "(answers_equal_cold)")
    # SGLang's --hicache-* flags and --hicache-config: the app's cache, as kvtier serve takes
    # them (--help shows kvtier serve's defaults)
    add_hicache_flags(p, HiCacheConfig(page_size=PAGE_SIZE,
                                       hicache_ratio=SERVE_DEFAULTS["hicache_ratio"]),
                      {"--page-size": f"refused: the bench sizes L1 in {PAGE_SIZE}-token pages",
                       "--hicache-storage-backend": "refused: the bench's L3 is a file "
                                                    "directory of its own",
                       EXTRA_CONFIG_FLAG: "refused: the bench's L3 is a file directory of "
                                          "its own"})
    app.add_argument("--port", type=int, default=8100, action=AppFlag,
                     help="HTTP port on 127.0.0.1 (default 8100)")


# ---- sizing ------------------------------------------------------------------------------
def estimated_history_tokens(rounds: int, turn_tokens: int, max_tokens: int,
                             first_turn_tokens: int = 0) -> int:
    """An upper estimate of the last round's prompt: every user turn (the first one
    `first_turn_tokens` words when set), every earlier answer and the chat template's tokens
    (705 measured for 3 x 200 words, 16-token answers; this says 746)."""
    words = (first_turn_tokens or turn_tokens) + (rounds - 1) * turn_tokens
    per_turn_template = TEMPLATE_TURN_TOKENS * rounds
    return (TEMPLATE_BASE_TOKENS + math.ceil(TOKENS_PER_WORD * words) + per_turn_template
            + (rounds - 1) * max_tokens)


def default_device_pages(rounds: int, turn_tokens: int, max_tokens: int,
                         page_size: int = PAGE_SIZE, chunk_tokens: int = CHUNK_TOKENS,
                         first_turn_tokens: int = 0) -> int:
    """L1 pages per rank: two whole conversations, and never below the smallest L1 whose
    `max_prompt_tokens` admits the last round (prompt + answer + one prefill chunk)."""
    history = estimated_history_tokens(rounds, turn_tokens, max_tokens, first_turn_tokens)
    floor = max(4, math.ceil((history + max_tokens + chunk_tokens) / page_size))
    return max(floor, 2 * conversation_pages(rounds, turn_tokens, max_tokens, page_size,
                                             first_turn_tokens))


def conversation_pages(rounds: int, turn_tokens: int, max_tokens: int,
                       page_size: int = PAGE_SIZE, first_turn_tokens: int = 0) -> int:
    """Pages one whole conversation (its last prompt and answer) occupies."""
    tokens = estimated_history_tokens(rounds, turn_tokens, max_tokens, first_turn_tokens)
    return math.ceil((tokens + max_tokens) / page_size)


# ---- settings ----------------------------------------------------------------------------
def device_pages_of(ns: argparse.Namespace) -> int:
    if ns.device_pages is not None:
        return ns.device_pages
    return default_device_pages(ns.rounds, ns.turn_tokens, ns.max_tokens,
                                chunk_tokens=ns.chunk_tokens,
                                first_turn_tokens=ns.first_turn_tokens)


def cache_flags(ns: argparse.Namespace) -> dict[str, Any]:
    """The app's cache settings from SGLang's flags given (hicache knobs, hicache_ratio);
    the ones the bench sets itself are refused."""
    config = config_from_args(ns)
    given = config.explicit or frozenset()
    for name, message in OWN_CACHE_FLAGS.items():
        if name in given:
            raise ConfigError(message)
    plain = config.to_dict()
    out: dict[str, Any] = {"hicache": {k: plain[k] for k in given if k not in HICACHE_OWNED}}
    if "hicache_ratio" in given:
        out["hicache_ratio"] = plain["hicache_ratio"]
    return out


def serve_settings(ns: argparse.Namespace, hierarchical: bool, l3_root: str = "") -> ServeSettings:
    """The app's settings for one run; the off run differs only in
    `enable_hierarchical_cache` (and so has no L3)."""
    return ServeSettings(engine=ns.engine, model=ns.model, instances=ns.instances,
                         page_size=PAGE_SIZE,
                         **cache_flags(ns),
                         chunk_tokens=ns.chunk_tokens, device_pages=device_pages_of(ns),
                         enable_hierarchical_cache=hierarchical,
                         storage_backend=StorageBackendKind.FILE if hierarchical else None,
                         l3_root=l3_root if hierarchical else "",
                         max_new_tokens=ns.max_tokens,
                         served_model_name=ns.served_model_name or "",
                         deterministic=ns.deterministic, schedule_policy=ns.schedule_policy,
                         dtype=ns.dtype)


def load_params(ns: argparse.Namespace) -> LoadParams:
    return LoadParams(clients=ns.clients, rounds=ns.rounds, turn_tokens=ns.turn_tokens,
                      first_turn_tokens=ns.first_turn_tokens,
                      max_tokens=ns.max_tokens, request_rate=ns.rate, seed=ns.seed,
                      model=ns.served_model_name or None,
                      timeout_s=ns.timeout, progress=not ns.json, api_key=ns.api_key)


def base_url_of(ns: argparse.Namespace) -> str:
    """--base-url as the load wants it: no trailing slash, no /v1 (the load adds /v1/...)."""
    url = ns.base_url.strip().rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise ConfigError(f"--base-url {ns.base_url!r}: expected http(s)://HOST:PORT, "
                          "optionally ending in /v1")
    return url.removesuffix("/v1")


def settings_report(ns: argparse.Namespace) -> dict[str, Any]:
    """What the result was measured with: the load's shape, and the app's settings (the
    admin key left out) or, with --base-url, the server's address."""
    load = {"clients": ns.clients, "rounds": ns.rounds, "rate": ns.rate,
            "turn_tokens": ns.turn_tokens, "first_turn_tokens": ns.first_turn_tokens,
            "max_tokens": ns.max_tokens, "seed": ns.seed}
    if ns.base_url is not None:
        return {"base_url": base_url_of(ns), "served_model_name": ns.served_model_name, **load}
    s = serve_settings(ns, True)
    pages = conversation_pages(ns.rounds, ns.turn_tokens, ns.max_tokens,
                               first_turn_tokens=ns.first_turn_tokens)
    secret = ("admin_key", "api_key", "l3_root", "l3_state_dir")
    values = {k: v for k, v in s.to_mapping().items() if k not in secret}
    # the report's keys for the cache on/off and its L3, as it has always printed them
    values["hierarchical"] = values.pop("enable_hierarchical_cache")
    values["l3"] = s.l3_name
    del values["storage_backend"]
    return {**values, **load, "port": ns.port, "compare_off": ns.compare_off,
            "conversation_pages": pages,
            "all_histories_pages": ns.clients * pages}


# ---- runs --------------------------------------------------------------------------------
@contextlib.contextmanager
def running_app(settings: ServeSettings, port: int) -> Iterator[str]:
    """The serve graph on a new local Ray cluster; its base URL. Stopped however the block
    exits (a failed start included: Ray may be up without the app)."""
    from kvtier.actors import serve_graph

    try:
        serve_graph.start(settings, host=LOOPBACK, port=port)
        yield f"http://{LOOPBACK}:{port}"
    finally:
        serve_graph.stop()


def run_once(ns: argparse.Namespace, hierarchical: bool) -> LoadResult:
    label = "cache on" if hierarchical else "cache off"
    l3_root = tempfile.mkdtemp(prefix="kvtier-bench-serve-l3-") if hierarchical else ""
    try:
        settings = serve_settings(ns, hierarchical, l3_root)
        if not ns.json:
            print(f"kvtier bench serve: starting the app ({label}, {settings.instances} "
                  f"instance(s), L1 {settings.device_pages} pages/rank)", file=sys.stderr,
                  flush=True)
        with running_app(settings, ns.port) as base_url:
            return run_load_sync(base_url, load_params(ns))
    finally:
        if l3_root:
            shutil.rmtree(l3_root, ignore_errors=True)


def run_vllm_alone(ns: argparse.Namespace) -> LoadResult:
    """The load against vLLM's own server, set up as the app's vLLM instance is (its block
    size, KV cache bytes, context and batch) without the connector (bench.serve_vllm_alone)."""
    from kvtier.actors.serve_vllm import vllm_settings
    from kvtier.bench.serve_vllm_alone import vllm_alone

    settings = serve_settings(ns, False)
    if not ns.json:
        print("kvtier bench serve: starting vLLM's own server (prefix caching on, no "
              "connector)", file=sys.stderr, flush=True)
    with vllm_alone(vllm_settings(settings, None), ns.port + 1,
                    settings.served_model_name) as base_url:
        return run_load_sync(base_url, load_params(ns))


def run_remote(ns: argparse.Namespace) -> LoadResult:
    """The load against the server at --base-url, as it runs."""
    url = base_url_of(ns)
    if not ns.json:
        print(f"kvtier bench serve: sending the load to {url}", file=sys.stderr, flush=True)
    return run_load_sync(url, load_params(ns))


def check(ns: argparse.Namespace) -> None:
    """Fail before any server starts (or any request goes out) on what the run could not do."""
    for name in ("clients", "rounds", "turn_tokens", "max_tokens"):
        if getattr(ns, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if ns.first_turn_tokens < 0:
        raise ConfigError("--first-turn-tokens must be 0 (as --turn-tokens) or more")
    if ns.rate < 0:
        raise ConfigError("--rate must be 0 (all at once) or more")
    if ns.base_url is None:
        serve_settings(ns, True).max_prompt_tokens  # ConfigError: an L1 with no room for a prompt
        if ns.engine == EngineKind.VLLM.value and ns.check_cold:
            raise ConfigError("--check-cold replays answers on kvtier's engine; with --engine "
                              "vllm drop it (the vLLM tests compare answers with vLLM alone)")
        return
    base_url_of(ns)
    cache = config_from_args(ns).explicit or frozenset()
    flags = list(dict.fromkeys(ns.app_flags))
    if cache:
        flags.append("SGLang's cache flags (" + ", ".join(sorted(cache)) + ")")
    if flags:
        raise ConfigError(f"--base-url sends the load to a server as it was started; "
                          f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} for kvtier's "
                          "own app, which the bench then does not start. Drop "
                          f"{'it' if len(flags) == 1 else 'them'} (for a cache-off baseline, run "
                          "the bench again against the server started with its cache off)")


def main(ns: argparse.Namespace) -> int:
    check(ns)
    if ns.base_url is not None:
        on, off = run_remote(ns), None
    else:
        with stdout_to_stderr(ns.json):
            on = run_once(ns, hierarchical=True)
            off = run_once(ns, hierarchical=False) if ns.compare_off else None
            alone = run_vllm_alone(ns) if ns.compare_off and ns.engine == "vllm" else None
    if off is not None:
        result = compare(on, off)
        complete = on.answered == on.planned and off.answered == off.planned
        if alone is not None:
            result["vllm_alone"] = alone.to_json()
            second = alone.ttft_by_round_s[1] if len(alone.ttft_by_round_s) > 1 else None
            result["vllm_alone_round2_ttft_s"] = second
            result["round2_vs_vllm_alone"] = round_ratio(on, alone, 1)
            complete = complete and alone.answered == alone.planned
    else:
        result = on.to_json()
        complete = on.answered == on.planned
    if ns.check_cold:
        from kvtier.bench.serve_cold import answers_equal_cold

        result["answers_equal_cold"] = answers_equal_cold(on.exchanges, serve_settings(ns, True),
                                                          ns.max_tokens)
    result = {"benchmark": "serve", **result, "settings": settings_report(ns)}
    emit(result, ns.json)
    return 0 if complete else 1
