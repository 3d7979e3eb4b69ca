"""The shared-root marker: proof that a rank sees the same `root_dir` as the namespace actor.

Why: the file and nixl backends keep pages as files under `root_dir`. With ranks on several
nodes that directory must be one filesystem mounted on every node; a node-local directory
(the default /tmp/kvtier-l3 is one) silently splits the store: pages a rank on one node
wrote are published to readers on another, who find nothing there. So the namespace actor
writes a marker object, `<root_dir>/.kvtier-root-<namespace>` holding a random token, when
it opens the namespace, and hands the token out in NamespaceInfo; every rank reads the
marker back from its own view of `root_dir` before it attaches (one small read), and a
missing or different marker is a `RootNotShared` error. On one host the check passes.

The marker sits at the top of `root_dir`, where the backends' scans never look (they index
`<root_dir>/<namespace>/<pool>/` only), and it is kept across actor restarts: a new
incarnation reads the token that is there instead of writing another.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import tempfile

from kvtier.backends.file_root import attach_root
from kvtier.errors import ConfigError
from kvtier.storage_options import FileOptions, NixlOptions, StorageOptions

log = logging.getLogger(__name__)

MARKER_PREFIX = ".kvtier-root-"
_HEADER = "kvtier shared-root marker"
_MAX_MARKER_BYTES = 256


class RootNotShared(ConfigError):
    """A rank's view of `root_dir` lacks the namespace actor's marker: not a shared filesystem."""


def shared_root_dir(options: StorageOptions) -> str | None:
    """The directory every rank must share for these options (file, nixl), else None."""
    return options.root_dir if isinstance(options, (FileOptions, NixlOptions)) else None


def marker_path(root_dir: str, namespace: str) -> str:
    return os.path.join(os.path.abspath(root_dir), MARKER_PREFIX + namespace)


def ensure_marker(root_dir: str, namespace: str, token: str = "") -> str:
    """The token of the namespace's marker in `root_dir` (created): the marker's own when one
    is there, else `token` (a new random one when empty), written atomically."""
    attach_root(root_dir, "L3 namespace")  # creates the root, or says why it cannot be used
    path = marker_path(root_dir, namespace)
    found, _ = _read_token(path)
    if found:
        return found
    token = token or secrets.token_hex(16)
    fd, tmp = tempfile.mkstemp(prefix=".kvtier-marker-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{_HEADER}\n{namespace}\n{token}\n")
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    log.info("L3 namespace %s: shared-root marker written to %s", namespace, path)
    return token


def check_marker(root_dir: str, namespace: str, token: str, node: str | None = None) -> None:
    """Read the marker back from this process's view of `root_dir`; RootNotShared unless it
    holds `token`."""
    path = marker_path(root_dir, namespace)
    found, why = _read_token(path)
    if found == token:
        return
    seen = (f"holds a marker with another token ({path}: an earlier run's, or another "
            "namespace actor's)") if found else why
    raise RootNotShared(
        f"L3 namespace {namespace}: storage_options root_dir {root_dir!r} on node "
        f"{node or socket.gethostname()} {seen}, so this rank does not see the directory the "
        "namespace actor wrote its marker into. With ranks on several nodes root_dir must be "
        "a filesystem mounted on every node (NFS, CephFS, Lustre, ...): mount one at root_dir "
        "on every node (or point root_dir at one) and register the namespace again, or use "
        "the mooncake backend")


def _read_token(path: str) -> tuple[str | None, str]:
    """The marker's token, or None and why there is none."""
    try:
        with open(path, "rb") as f:
            lines = f.read(_MAX_MARKER_BYTES).decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None, f"has no marker {path}"
    except OSError as exc:
        return None, f"cannot be read ({path}: {exc.strerror or exc})"
    if len(lines) != 3 or lines[0] != _HEADER or not lines[2]:
        return None, f"holds a damaged marker {path}"
    return lines[2], ""


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
