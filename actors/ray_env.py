"""Start and stop a local Ray cluster that stays on 127.0.0.1.

Why a helper: Ray 2.60 binds the machine's external interface even when told 127.0.0.1
unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is set before it starts; token auth is on by
default; the dashboard opens ports nobody here uses; and a plain `ray.init()` joins a stale
cluster that a killed run left in /tmp/ray/ray_current_cluster (`address="local"` never
does). Every test, example and the CLI start Ray through `start_local_ray`.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # keeps every Ray socket on loopback
NO_AUTH_ENV = {"RAY_AUTH_MODE": "disabled"}  # a single-user local cluster: no token files
os.environ.update(LOOPBACK_ENV)  # Ray reads it once, when `ray` is first imported

import ray  # noqa: E402
from ray._private import ray_constants  # noqa: E402

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
MiB = 1 << 20
DEFAULT_OBJECT_STORE_BYTES = 128 * MiB  # Ray's minimum is ~75 MiB; pages never go through it


def pin_to_loopback(*, auth: bool = False) -> None:
    """Keep every Ray process this one starts on 127.0.0.1 (and, unless `auth`, without
    token auth). `start_local_ray` calls it; call it yourself before starting nodes another
    way (`ray.cluster_utils.Cluster` in the multi-node test)."""
    os.environ.update(LOOPBACK_ENV)  # Ray's processes inherit it
    if ray_constants.ENABLE_RAY_CLUSTER:
        # `ray` was imported before this module: the flag was read already. Ray's own
        # services look it up at call time, so set it the way the variable would have.
        ray_constants.ENABLE_RAY_CLUSTER = False
    if not auth:
        os.environ.update(NO_AUTH_ENV)


def start_local_ray(num_cpus: int = 2, object_store_memory: int = DEFAULT_OBJECT_STORE_BYTES,
                    *, auth: bool = False, **init_kwargs: Any) -> Any:
    """A new single-node cluster on 127.0.0.1 (never an existing one), no dashboard.

    `auth=False` sets RAY_AUTH_MODE=disabled (tests, demos); extra keyword arguments go to
    `ray.init`. Returns Ray's context; stop it with `shutdown_local_ray()`.
    """
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process; call shutdown_local_ray() "
                           "first, or use the running cluster")
    pin_to_loopback(auth=auth)
    init_kwargs.setdefault("log_to_driver", False)  # actors log to files, not the test output
    ctx = ray.init(address="local", num_cpus=num_cpus, object_store_memory=object_store_memory,
                   include_dashboard=False, _node_ip_address=LOOPBACK, **init_kwargs)
    log.info("local Ray cluster on %s: %d CPUs, session %s", LOOPBACK, num_cpus,
             ctx.address_info.get("session_dir"))
    return ctx


def cluster_address() -> str:
    """The address processes join this process's Ray cluster by (its GCS, host:port)."""
    return ray.get_runtime_context().gcs_address


def shutdown_local_ray() -> None:
    """Stop the cluster this process started (its detached actors end with it)."""
    if ray.is_initialized():
        ray.shutdown()


@contextlib.contextmanager
def local_ray(num_cpus: int = 2, object_store_memory: int = DEFAULT_OBJECT_STORE_BYTES,
              **kwargs: Any) -> Iterator[Any]:
    """`with local_ray(2) as ctx:` -- the cluster is shut down however the block exits."""
    ctx = start_local_ray(num_cpus, object_store_memory, **kwargs)
    try:
        yield ctx
    finally:
        shutdown_local_ray()


def keep_serve_replica_on_loopback() -> None:
    """Bind this Serve replica's inter-deployment gRPC server to 127.0.0.1.

    Why: Ray Serve 2.60 starts that server in every replica on `[::]:0` (all interfaces),
    after the deployment's `__init__`, although handle calls use it only with
    `RAY_SERVE_USE_GRPC_BY_DEFAULT=1`. Called from each kvtier deployment's `__init__`, this
    rewrites the address the replica is about to bind; with that variable set it does
    nothing (the server must then be reachable from other nodes: keep them on a private
    network).
    """
    if os.environ.get("RAY_SERVE_USE_GRPC_BY_DEFAULT") == "1":
        return
    from ray.serve._private import replica

    real = replica.add_port_to_grpc_server
    if getattr(real, "_kvtier_loopback", False):
        return

    def add_port(server: Any, address: str) -> Any:
        if address.startswith("[::]:"):
            address = f"{LOOPBACK}:{address[len('[::]:'):]}"
        return real(server, address)

    add_port._kvtier_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port
