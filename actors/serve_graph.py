"""The serve graph: HTTP ingress -> router -> N instance deployments (or one prefill/decode
deployment of P + D instances, actors/pd/deployment), plus the L3 namespace actor (created by the
first instance that attaches L3), and `kvtier serve`.

    kvtier serve --host 127.0.0.1 --port 8000            # a local Ray cluster, SmolLM2, file L3
    serve run examples/serve_config.yaml                  # the same graph from a Serve config

`build_app(settings)` returns the Serve application; `app_builder(args)` is the entry point a
Serve config names (`import_path: kvtier.actors.serve_graph:app_builder`), its `args` being
`ServeSettings` keys.
"""
from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
from typing import Any

from kvtier.actors.cluster_placement import place
from kvtier.actors.pd.deployment import PD_NAME, PDDeployment
from kvtier.actors.rank_actor import Rank
from kvtier.actors.serve_ingress import Ingress
from kvtier.actors.serve_instance import InstanceDeployment
from kvtier.actors.serve_router import RouterDeployment
from kvtier.actors.serve_vllm import VllmDeployment
from kvtier.policies import StorageBackendKind
from kvtier.frontend.admin_key_file import save_admin_key
from kvtier.frontend.placement import PlacementMode
from kvtier.frontend.settings import EngineKind, ServeSettings

log = logging.getLogger(__name__)

APP_NAME = "kvtier"


def resolve(settings: ServeSettings) -> ServeSettings:
    """Settings every deployment can use as they are: a file/nixl L3 without a directory gets
    one temporary directory, shared by all instances (they must see each other's pages), and
    the namespace actor a registry beside it; an `auto` L3 bound is measured there, once
    (frontend/l3_bound.py)."""
    import dataclasses

    # L3 off with peers: the namespace's directory alone, registered on a file root that
    # nothing writes (actors/serve_replica.py)
    directory = settings.storage_backend is None and settings.peer_transport is not None
    if (settings.storage_backend in (StorageBackendKind.FILE, StorageBackendKind.NIXL)
            or directory) and not settings.l3_root:
        root = tempfile.mkdtemp(prefix="kvtier-serve-l3-")
        settings = dataclasses.replace(settings, l3_root=root)
    if (settings.storage_backend is not None or directory) and not settings.l3_state_dir:
        state = (os.path.join(settings.l3_root, ".kvtier-l3-state") if settings.l3_root
                 else tempfile.mkdtemp(prefix="kvtier-serve-l3-state-"))
        settings = dataclasses.replace(settings, l3_state_dir=state)
    return settings.with_l3_bound()


# On a cluster the ingress, the router and each instance's driver (its deployment replica)
# run beside Serve's HTTP proxy on the head node (HeadOnly), the ranks on instance nodes: a
# worker host that fails or is cut off takes its own instance away, never the API, the
# routing or another instance's driver.
_ON_HEAD = {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}


def build_app(settings: ServeSettings, rank_class: type[Rank] = Rank) -> Any:
    """The bound application: `Ingress(router, instances)` (a prefill/decode graph: one
    deployment, `pd`, in place of the instances). `rank_class`: what the rank actors run
    (tests pass one that injects faults)."""
    s = resolve(settings)
    values = s.to_mapping()
    on_head = {"ray_actor_options": _ON_HEAD} if s.placement is PlacementMode.RESOURCES else {}
    instances = {}
    if s.pd:
        instances[PD_NAME] = PDDeployment.options(name=PD_NAME, **on_head).bind(
            PD_NAME, values, rank_class)
    for index, name in enumerate(instance_names(s)):
        if s.engine is EngineKind.VLLM:  # its replica runs the engine: it holds the CPUs
            cpus = {"num_cpus": s.num_cpus_per_rank * s.tp_size}
            instances[name] = VllmDeployment.options(name=name, ray_actor_options=cpus).bind(
                name, values, index)
            continue
        instances[name] = InstanceDeployment.options(name=name, **on_head).bind(
            name, values, rank_class)
    router, ingress = RouterDeployment, Ingress
    if on_head:
        router, ingress = router.options(**on_head), ingress.options(**on_head)
    return ingress.bind(router.bind(instances, values), instances, values)


def instance_names(settings: ServeSettings) -> list[str]:
    """The instance deployments of a graph without prefill/decode: `instance-<i>`."""
    return [] if settings.pd else [f"instance-{i}" for i in range(settings.instances)]


def app_builder(args: dict[str, Any]) -> Any:
    """For Serve config files: `args` are ServeSettings keys. Without `admin_key`, the random
    key is written to a file only this user can read (frontend/admin_key_file.py), whose path,
    never the key, is logged."""
    settings = ServeSettings.from_mapping(args or {})
    if not (args or {}).get("admin_key"):
        log.warning("no admin_key in the Serve config: the admin endpoints use a random key, "
                    "written to %s (readable by you only; set admin_key to choose one)",
                    save_admin_key(settings.admin_key))
    return build_app(place(settings, joined=None))  # checked before any deployment starts


def start(settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000,
          address: str | None = None, rank_class: type[Rank] = Rank) -> Any:
    """Start (or join, with `address`: see actors/ray_join.py) Ray and Serve and deploy the
    graph; its handle. A placement the cluster cannot meet fails before Serve starts."""
    from ray import serve

    from kvtier.actors.ray_env import start_local_ray
    from kvtier.actors.ray_join import join_cluster

    if address is None:
        start_local_ray(num_cpus=max(2, settings.rank_cpus + 1))
    else:
        join_cluster(address)
    settings = place(settings, joined=address is not None)
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    return _run(settings, rank_class)


def deploy(settings: ServeSettings, rank_class: type[Rank] = Rank,
           joined: bool = False) -> Any:
    """Deploy the graph on the Serve that `start` began (in place of an app running there:
    delete it first, and a namespace actor it left whose L3 root differs), checked against
    the cluster as `start` does; its handle. Lets one cluster serve several graphs in turn
    (the serve tests' modules)."""
    return _run(place(settings, joined=joined), rank_class)


def _run(settings: ServeSettings, rank_class: type[Rank]) -> Any:
    from ray import serve

    return serve.run(build_app(settings, rank_class), name=APP_NAME, route_prefix="/",
                     blocking=False)


def stop(joined: bool = False) -> None:
    """Delete the app, stop Serve and the local Ray cluster (and its namespace actor). On a
    cluster kvtier `joined`, only the app goes: Serve, the namespace actor and the cluster
    stay for whoever else uses them, and this process disconnects."""
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    from kvtier.actors.ray_env import shutdown_local_ray

    if ray.is_initialized():
        try:
            if not joined:
                serve.shutdown()
            else:
                try:
                    serve.delete(APP_NAME)
                except RayServeException:  # Serve never started (placement failed first)
                    pass
        finally:
            shutdown_local_ray()


def serve_forever(settings: ServeSettings, host: str, port: int, address: str | None,
                  key_file: str | None = None) -> None:
    """`kvtier serve`: deploy, print where it listens and where the admin key is (`key_file`,
    when it was generated; never the key), wait for Ctrl-C."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        start(settings, host, port, address)
        shape = (f"{settings.prefill_instances} prefill + {settings.decode_instances} decode "
                 f"instances over {settings.pd_transport}" if settings.pd
                 else f"{settings.instances} instances")
        peers = (f", L2 shared over {settings.peer_transport.value}"
                 if settings.peer_transport is not None else "")
        print(f"kvtier: serving {settings.served_model_name} on http://{host}:{port}/v1 "
              f"({shape}, TP={settings.tp_size}, L3={settings.l3_name}{peers})", flush=True)
        print(f"kvtier: admin key: generated, in {key_file} (readable by you only)" if key_file
              else "kvtier: admin key: the one given with --admin-key", flush=True)
        done.wait()
    finally:
        stop(joined=address is not None)
