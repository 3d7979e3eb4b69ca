"""Create backends by kind, importing each backend's module only when it is used."""
from __future__ import annotations

import importlib

from kvtier.backends.base import StorageBackend, StorageTarget, StorageUnavailable
from kvtier.policies import StorageBackendKind
from kvtier.storage_options import StorageOptions, parse_storage_options

_BACKENDS: dict[StorageBackendKind, str] = {
    StorageBackendKind.FILE: "kvtier.backends.file_backend:FileBackend",
    StorageBackendKind.MOONCAKE: "kvtier.backends.mooncake_backend:MooncakeBackend",
    StorageBackendKind.NIXL: "kvtier.backends.nixl_backend:NixlBackend",
    StorageBackendKind.SIMULATED: "kvtier.backends.simulated:SimulatedBackend",
}


def backend_class(kind: StorageBackendKind | str) -> type[StorageBackend]:
    kind = StorageBackendKind.parse(kind, "--hicache-storage-backend")
    module_name, cls_name = _BACKENDS[kind].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise StorageUnavailable(
            f"the {kind} backend cannot be imported ({exc}); install its package "
            "(`make` installs mooncake-transfer-engine and nixl) or choose another backend") from exc
    return getattr(module, cls_name)


def create_backend(kind: StorageBackendKind | str, target: StorageTarget,
                   options: StorageOptions | dict | None = None) -> StorageBackend:
    """A backend of `kind` for `target`, with options validated for that kind."""
    kind = StorageBackendKind.parse(kind, "--hicache-storage-backend")
    opts = parse_storage_options(kind, options if options is not None else {})
    return backend_class(kind)(opts, target)
