"""Open a transport endpoint by kind, importing each transport's module only when it is used."""
from __future__ import annotations

import importlib

from kvtier.backends.transport_base import TransportEndpoint
from kvtier.policies import Transport

_ENDPOINTS: dict[Transport, str] = {
    Transport.NIXL: "kvtier.backends.transport_nixl:NixlEndpoint",
    Transport.MOONCAKE: "kvtier.backends.transport_mooncake:MooncakeEndpoint",
    Transport.SIMULATED: "kvtier.backends.transport_simulated:SimulatedEndpoint",
}


def open_endpoint(kind: Transport | str, name: str, **options) -> TransportEndpoint:
    """An endpoint of `kind` named `name` (a rank's role and index, say "prefill-0-tp1").

    `options` go to the transport (MooncakeEndpoint: local_hostname, protocol, device_name).
    A transport whose library is missing raises TransportUnavailable naming the pip package.
    """
    kind = Transport.parse(kind, "transport")
    module_name, cls_name = _ENDPOINTS[kind].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(name, **options)
