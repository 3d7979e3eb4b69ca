"""`kvtier serve`: the serve graph on a local Ray cluster (or a running one, `--address`)."""
from __future__ import annotations

import argparse
import os
from typing import Any

from kvtier.config import HiCacheConfig
from kvtier.errors import ConfigError
from kvtier.cli.flags import add_hicache_flags, config_from_args, l3_from_flags
from kvtier.cli.shared_flags import (add_dtype_flag, add_l3_flag, add_l3_root_flag,
                                     add_model_flag, add_pd_transport_flag,
                                     add_schedule_policy_flag, add_tp_flag)
from kvtier.policies import StorageBackendKind, Transport
from kvtier.frontend.admin_key_file import save_admin_key
from kvtier.frontend.l3_bound import describe_l3_bound
from kvtier.frontend.placement import PlacementMode, RankGpus
from kvtier.frontend.settings import HICACHE_OWNED, L3_NONE, EngineKind, ServeSettings
from kvtier.frontend.tenants import load_api_keys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="HTTP address (default 127.0.0.1; anything else exposes the API)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None,
                   help="join this Ray cluster instead of starting a local one (run on one of "
                        "its nodes; with token auth, set RAY_AUTH_MODE=token and the token)")
    p.add_argument("--placement", choices=[m.value for m in PlacementMode], default="auto",
                   help="resources: the namespace actor on a node offering kvtier_head, "
                        "each rank on 1 unit of kvtier_instance, checked before deploying; "
                        "anywhere: no custom resources; auto (default): resources with "
                        "--address, anywhere on the local cluster")
    p.add_argument("--gpus-per-rank", choices=[m.value for m in RankGpus], default="auto",
                   help="1: each rank asks Ray for a GPU of its own (an error where the nodes "
                        "lack them); 0: CPU ranks; auto (default): 1 where the nodes' GPUs "
                        "hold every instance's ranks, else 0 with a warning")
    p.add_argument("--engine", choices=[e.value for e in EngineKind],
                   default=EngineKind.KVTIER.value,
                   help="what each instance runs: kvtier (default: kvtier's reference engine) "
                        "or vllm (a vLLM engine with KvtierConnector as its L2 and L3; "
                        "--model smollm2 or a Hugging Face directory; docs/vllm.md)")
    add_model_flag(p, note="; a GGUF file holds its tokenizer and chat template, Gemma's "
                           "template is built in")
    p.add_argument("--instances", type=int, default=None,
                   help="model replicas behind the router, each prefilling and decoding its "
                        "requests (default 2)")
    p.add_argument("--prefill-instances", type=int, default=0, metavar="P",
                   help="prefill/decode disaggregation: P instances compute every prompt and "
                        "hand its KV to a decode instance (with --decode-instances, in place "
                        "of --instances)")
    p.add_argument("--decode-instances", type=int, default=0, metavar="D",
                   help="prefill/decode disaggregation: D instances decode every answer from "
                        "the KV a prefill instance sent them (with --prefill-instances)")
    add_pd_transport_flag(p, None, "; only with --prefill-instances/--decode-instances")
    p.add_argument("--pd-decode-l3", action=argparse.BooleanOptionalAction, default=True,
                   help="decode instances store the conversations they finish in L3, so the "
                        "next turn's prefill hits the answer too (default on; "
                        "--no-pd-decode-l3: prefill instances only use L3)")
    p.add_argument("--peer-transport", choices=tuple(t.value for t in Transport.across_processes()),
                   default=None,
                   help="peer-to-peer L2: each instance reads the pages others hold in L2 when "
                        "L3 has fewer of them, over this transport (default off)")
    add_tp_flag(p, 1)
    # every kind: ServeSettings checks it, as it does a serve config file's `storage_backend`
    add_l3_flag(p, None, kinds=tuple(StorageBackendKind), allow_none=True,
                note="; SGLang's --hicache-storage-backend says the same")
    add_l3_root_flag(p)
    p.add_argument("--l3-max-gb", default="auto", metavar="GIB|auto|unbounded",
                   help="file/nixl: the L3 namespace's size in GiB; past it the least recently "
                        "used pages are evicted. Default auto: half the disk space free where "
                        "--l3-root lives at start (printed then); unbounded: no bound, the "
                        "disk fills up with pages")
    p.add_argument("--device-pages", type=int, default=160, help="L1 pages per rank")
    p.add_argument("--chunk-tokens", type=int, default=512,
                   help="most new tokens one forward computes: prefill pieces of several "
                        "requests and the decodes share it (a multiple of 64; default 512)")
    add_dtype_flag(p)
    p.add_argument("--deterministic", action="store_true",
                   help="answers bit-identical to a cold run: one-page prefill chunks, one "
                        "sequence per forward, only prompt pages cached (slower, reuses less)")
    add_schedule_policy_flag(p)
    p.add_argument("--no-hierarchical", action="store_true",
                   help="the cache off: L1 only, no L2/L3 (a baseline)")
    p.add_argument("--admin-key", default="",
                   help="the admin endpoints' bearer key, at least 16 characters (default: a "
                        "random key, written to $XDG_STATE_HOME/kvtier/admin-key, else "
                        "~/.local/state/kvtier/admin-key, readable by you only)")
    p.add_argument("--api-key", default=os.environ.get("KVTIER_API_KEY", ""),
                   help="the OpenAI endpoints answer 401 without 'Authorization: Bearer KEY' "
                        "(default: $KVTIER_API_KEY, else open)")
    p.add_argument("--api-keys-file", default="", metavar="JSON",
                   help='several tenants: a JSON object of API key -> tenant, e.g. '
                        '{"sk-a1": "acme", "sk-b1": "globex"}; each tenant hits only prefixes '
                        'its own requests cached (a request\'s cache_salt field narrows that '
                        'further)')
    p.add_argument("--served-model-name", default="",
                   help="the model name the API lists and requests name (default: the "
                        "model's own)")
    p.add_argument("--tenant-salt", default="",
                   help="this deployment's tenant: seeds its page keys and L3 namespace")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stall-timeout-s", type=float, default=2.0,
                   help="an instance with work that completes no step (or answers no poll) "
                        "for this long is routed around and its unanswered requests are sent "
                        "to another instance, until it steps again (default 2)")
    p.add_argument("--request-timeout-s", type=float, default=ServeSettings.request_timeout_s,
                   help="a request still unanswered this long after it arrived is stopped: its "
                        "answers are cancelled and the client gets a 504 (default 300)")
    p.add_argument("--pin-max-fraction", type=float, default=ServeSettings.pin_max_fraction,
                   help="pinned prefixes (POST /admin/pin) may hold at most this share of "
                        "each rank's L2 and of the L3 bound (0-1, default 0.5); a pin past it "
                        "is refused with a 409 saying how much room is missing")
    # SGLang's --hicache-* flags and --hicache-config: every rank's cache (--help shows the
    # deployment's own page size and ratio)
    add_hicache_flags(p, HiCacheConfig(page_size=ServeSettings.page_size,
                                       hicache_ratio=ServeSettings.hicache_ratio))


def settings_from(ns: argparse.Namespace) -> ServeSettings:
    cache = _cache_settings(ns)
    if ns.instances is not None and ns.instances < 1:  # 0 is the setting's "not given"
        raise ConfigError(f"--instances {ns.instances}: give at least 1")
    return ServeSettings(engine=ns.engine, model=ns.model, instances=ns.instances,
                         prefill_instances=ns.prefill_instances,
                         decode_instances=ns.decode_instances, pd_transport=ns.pd_transport,
                         pd_decode_l3=ns.pd_decode_l3, peer_transport=ns.peer_transport,
                         tp_size=ns.tp, **cache,
                         device_pages=ns.device_pages, chunk_tokens=ns.chunk_tokens,
                         deterministic=ns.deterministic, schedule_policy=ns.schedule_policy,
                         dtype=ns.dtype, admin_key=ns.admin_key, api_key=ns.api_key,
                         served_model_name=ns.served_model_name, max_new_tokens=ns.max_new_tokens,
                         tenant_salt=ns.tenant_salt, stall_timeout_s=ns.stall_timeout_s,
                         request_timeout_s=ns.request_timeout_s,
                         l3_max_gb=ns.l3_max_gb, pin_max_fraction=ns.pin_max_fraction,
                         placement=ns.placement, gpus_per_rank=ns.gpus_per_rank,
                         api_keys=load_api_keys(ns.api_keys_file) if ns.api_keys_file else {})


def _cache_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """The deployment's cache settings from kvtier's flags and SGLang's (--hicache-*,
    --page-size, --enable/--disable-hierarchical-cache, --hicache-config), checked together."""
    config = config_from_args(ns)  # validates the --hicache-* flags and the config file
    given = config.explicit or frozenset()
    plain = config.to_dict()
    if plain["disable_radix_cache"]:
        raise ConfigError("--disable-radix-cache: kvtier serve always keeps the prefix cache; "
                          "use --disable-hierarchical-cache (or --no-hierarchical) for L1 only")
    out: dict[str, Any] = {"hicache": {k: plain[k] for k in given if k not in HICACHE_OWNED}}
    if "page_size" in given:
        out["page_size"] = plain["page_size"]
    if "hicache_ratio" in given:
        out["hicache_ratio"] = plain["hicache_ratio"]
    hierarchical = not ns.no_hierarchical and plain["enable_hierarchical_cache"]
    l3 = l3_from_flags(config, ns.l3, ns.l3_root, "kvtier serve")  # --l3 or SGLang's flag
    out["enable_hierarchical_cache"] = hierarchical
    out["storage_backend"] = (l3.backend or StorageBackendKind.FILE.value) if hierarchical \
        else L3_NONE
    out["l3_root"] = l3.root
    return out


def main(ns: argparse.Namespace) -> int:
    from kvtier.actors.serve_graph import resolve, serve_forever

    asked = settings_from(ns)
    settings = resolve(asked)  # the L3 root and its bound, fixed once for every instance
    if settings.storage_backend in (StorageBackendKind.FILE, StorageBackendKind.NIXL):
        line = describe_l3_bound(asked.l3_max_gb, settings.l3_max_gb, settings.l3_root)
        print(f"kvtier: {line}", flush=True)
    # a generated key goes to a file of the user's only (a given one is written nowhere)
    key_file = None if ns.admin_key else str(save_admin_key(settings.admin_key))
    serve_forever(settings, ns.host, ns.port, ns.address, key_file)
    return 0
