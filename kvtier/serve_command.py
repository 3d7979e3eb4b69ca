"""`kvtier serve`: the serve graph on a local Ray cluster (or a running one, `--address`)."""
from __future__ import annotations

import argparse

from kvtier.policies import SchedulePolicy
from kvtier.serve.placement import PlacementMode
from kvtier.serve.settings import L3_NONE, DType, ModelChoice, ServeSettings


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
    p.add_argument("--model", choices=[m.value for m in ModelChoice], default="smollm2")
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="TP ranks per instance")
    p.add_argument("--l3", default="file", help="file, mooncake, nixl or none")
    p.add_argument("--l3-root", default="", help="file/nixl L3 directory (default: a temp dir)")
    p.add_argument("--device-pages", type=int, default=160, help="L1 pages per rank")
    p.add_argument("--chunk-tokens", type=int, default=512,
                   help="most new tokens one forward computes: prefill pieces of several "
                        "requests and the decodes share it (a multiple of 64; default 512)")
    p.add_argument("--dtype", choices=[m.value for m in DType], default="auto",
                   help="model and KV dtype (default auto: bf16 on GPUs and CPUs that compute "
                        "in bf16, fp32 on other CPUs, where bf16 is about 4x slower)")
    p.add_argument("--deterministic", action="store_true",
                   help="answers bit-identical to a cold run: one-page prefill chunks, one "
                        "sequence per forward, only prompt pages cached (slower, reuses less)")
    p.add_argument("--schedule-policy", choices=[m.value for m in SchedulePolicy],
                   default="lpm", help="admission order: lpm (longest cached prefix first, "
                   "with aging; default) or fcfs (arrival order)")
    p.add_argument("--no-hierarchical", action="store_true",
                   help="the cache off: L1 only, no L2/L3 (a baseline)")
    p.add_argument("--admin-key", default="", help="default: a random key, printed at start")
    p.add_argument("--tenant-salt", default="",
                   help="this deployment's tenant: seeds its page keys and L3 namespace")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stall-timeout-s", type=float, default=2.0,
                   help="an instance with work that completes no step (or answers no poll) "
                        "for this long is routed around and its unanswered requests are sent "
                        "to another instance, until it steps again (default 2)")


def settings_from(ns: argparse.Namespace) -> ServeSettings:
    return ServeSettings(model=ns.model, instances=ns.instances, tp_size=ns.tp,
                         l3=ns.l3 if not ns.no_hierarchical else L3_NONE, l3_root=ns.l3_root,
                         device_pages=ns.device_pages, chunk_tokens=ns.chunk_tokens,
                         deterministic=ns.deterministic, schedule_policy=ns.schedule_policy,
                         dtype=ns.dtype,
                         hierarchical=not ns.no_hierarchical,
                         admin_key=ns.admin_key, max_new_tokens=ns.max_new_tokens,
                         tenant_salt=ns.tenant_salt, stall_timeout_s=ns.stall_timeout_s,
                         placement=ns.placement)


def main(ns: argparse.Namespace) -> int:
    from kvtier.actors.serve_graph import serve_forever

    serve_forever(settings_from(ns), ns.host, ns.port, ns.address)
    return 0
