"""Join an existing Ray cluster (`kvtier serve --address`) as stock Ray would: not pinned to
loopback, its auth left as the cluster has it.

Why a helper: importing actors/ray_env (every actor module does) sets
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which Ray 2.60 reads once into
`ray_constants.ENABLE_RAY_CLUSTER`. A driver that joins attaches to the raylet on its own host
and takes that node's address from the cluster, so a head on a routable address was reached
either way when tried on one host (head on 192.0.2.2, driver beside it). What the flag does
change (ray/_private/services.py) is that `services.get_node_ip_address()` answers
127.0.0.1 until `ray.init` returns, so a loopback `--address` (`127.0.0.1:6379`,
`localhost:6379` on the head) is kept as 127.0.0.1 instead of becoming the node's address,
and that any process started from here inherits the variable. Joining a routable address
undoes both: the flag gets Ray's cluster value again and the variable leaves this process's
environment. A loopback address keeps the pin: it names a cluster on this machine, and one
pinned to loopback (tests, cluster.yaml's one-machine trial) listens on 127.0.0.1 only, where
stock Ray's rewrite to the machine's address would miss it.

An address where no Ray answers fails within GCS_PROBE_TIMEOUT_S (5 s): before `ray.init`,
which keeps retrying an absent GCS for many minutes (Ray 2.60: about 40 s per attempt, 20
attempts; its own timeouts are read once, when Ray is imported, so they cannot be shortened
here), a plain TCP connect to the address must open and an HTTP/2 greeting (Ray's GCS is a
gRPC server) be answered with the server's own, all within that bound. A refused or silent
port, or one of another kind of server (the dashboard's :8265), is a ClusterJoinError naming
the address. Addresses that are not host:port (`auto`, `ray://...`) and TLS clusters
(RAY_USE_TLS) are left to Ray.

Auth is left as it is: nothing here sets RAY_AUTH_MODE or a token. Ray 2.60 finds the token
in RAY_AUTH_TOKEN, a file named by RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, but sends it to
an explicit address only when RAY_AUTH_MODE=token (it turns token mode on by itself only for a
cluster it finds on its own); without it a cluster with token auth answers "Failed to
connect", so the errors below say so.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from typing import Any

import ray
from ray._private import ray_constants
from ray.exceptions import AuthenticationError

from kvtier.errors import ClusterJoinError

log = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"
GCS_PROBE_TIMEOUT_S = 5.0  # how long an address may take to show a gRPC server (the GCS)
# An HTTP/2 client's greeting: the connection preface, then an empty SETTINGS frame (RFC 9113
# section 3.4). A gRPC server answers with a SETTINGS frame of its own, first thing.
_H2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 4  # the frame type, the 4th byte of a frame's 9-byte header
TOKEN_HELP = ("put the cluster's token (`ray get-auth-token` on the head prints it) in "
              "RAY_AUTH_TOKEN, in a file named by RAY_AUTH_TOKEN_PATH, or in ~/.ray/auth_token "
              "on this node")


def unpin_from_loopback() -> None:
    """Undo what importing actors/ray_env did to this process: Ray resolves addresses and
    picks this node's address as it does by default on a cluster."""
    os.environ.pop(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, None)
    ray_constants.ENABLE_RAY_CLUSTER = True  # services.py reads it at call time


def is_loopback(address: str) -> bool:
    """`127.0.0.1:6379`, `localhost:6379`, `[::1]:6379` (a host without a port too)."""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or "]" in address else address
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_available() -> bool:
    """Whether Ray would find a token here (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH,
    ~/.ray/auth_token), whatever RAY_AUTH_MODE says."""
    from ray._raylet import AuthenticationTokenLoader

    return AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)


def _auth_hint() -> str:
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is None:
        return ("set RAY_AUTH_MODE=token (Ray sends no token to an explicit address without "
                "it) and " + TOKEN_HELP)
    if mode.lower() == "token":
        return "the token here must be the cluster's: " + TOKEN_HELP
    return f"RAY_AUTH_MODE={mode} here sends no token: set RAY_AUTH_MODE=token and {TOKEN_HELP}"


def gcs_silence(address: str, timeout_s: float = GCS_PROBE_TIMEOUT_S) -> str | None:
    """Why no Ray GCS can answer at `address` (host:port), found within `timeout_s`; None
    when a gRPC server answers there, or the address is one this check leaves to Ray."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")  # as Ray reads it
    if not host or "/" in host or not port.isdigit() or tls:
        return None
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            conn.sendall(_H2_GREETING)
            head = b""
            while len(head) < 9:
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = conn.recv(9 - len(head))
                if not chunk:
                    break
                head += chunk
    except socket.timeout:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return f"cannot connect ({exc.strerror or exc})"
    if len(head) == 9 and head[3] == _H2_SETTINGS:
        return None
    return "a server answers there, but not Ray's GCS (a gRPC server): another port?"


def join_cluster(address: str, **init_kwargs: Any) -> Any:
    """`ray.init(address=address)` on a cluster started elsewhere; Ray's context. Errors
    say what to do: ClusterJoinError for an address where no Ray answers (within
    GCS_PROBE_TIMEOUT_S), a missing token, an unreachable head, or a driver that is not on
    one of the cluster's nodes."""
    if ray.is_initialized():
        raise ClusterJoinError("Ray is already initialized in this process; join a cluster "
                               "from a fresh process")
    why = gcs_silence(address)
    if why is not None:
        raise ClusterJoinError(
            f"no Ray cluster answers at {address}: {why}. Check the address (the head's GCS, "
            "host:6379 unless `ray start --head --port` said otherwise; not the dashboard's "
            f"host:8265) and that this node reaches it (`ray status --address {address}`)")
    if not is_loopback(address):
        unpin_from_loopback()
    if AUTH_MODE_ENV not in os.environ and token_available():
        log.warning("a Ray auth token is available here but RAY_AUTH_MODE is unset, so Ray will "
                    "not send it to %s; set RAY_AUTH_MODE=token if the cluster uses token auth",
                    address)
    init_kwargs.setdefault("log_to_driver", False)
    try:
        ctx = ray.init(address=address, **init_kwargs)
    except AuthenticationError as exc:
        raise ClusterJoinError(f"joining the Ray cluster at {address}: {exc.message}; "
                               f"{TOKEN_HELP}") from None
    except ConnectionError as exc:
        raise ClusterJoinError(
            f"could not join the Ray cluster at {address} ({exc}). Check that its head runs "
            f"there and this node reaches it (`ray status --address {address}`); if the "
            f"cluster uses token auth, {_auth_hint()}") from exc
    except RuntimeError as exc:
        if "node to connect to" not in str(exc):
            raise
        raise ClusterJoinError(
            f"joining the Ray cluster at {address}: no Ray node runs on this machine ({exc}). "
            f"A Ray driver attaches to its own host's node: run this on a node of the "
            f"cluster (the head, or one started with `ray start --address={address}`)"
        ) from exc
    log.info("joined the Ray cluster at %s (node %s)", address,
             ctx.address_info.get("node_ip_address"))
    return ctx
