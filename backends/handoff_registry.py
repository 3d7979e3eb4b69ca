"""Open a handoff endpoint by kind, importing each transport's module only when it is used."""
from __future__ import annotations

import importlib

from kvtier.backends.handoff_base import HandoffEndpoint
from kvtier.policies import Transport

_ENDPOINTS: dict[Transport, str] = {
    Transport.NIXL: "kvtier.backends.handoff_nixl:NixlEndpoint",
    Transport.MOONCAKE: "kvtier.backends.handoff_mooncake:MooncakeEndpoint",
    Transport.SIMULATED: "kvtier.backends.handoff_simulated:SimulatedEndpoint",
}


def open_endpoint(kind: Transport | str, name: str, **options) -> HandoffEndpoint:
    """An endpoint of `kind` named `name` (a rank's role and index, say "prefill-0-tp1").

    `options` go to the transport (MooncakeEndpoint: local_hostname, protocol, device_name).
    A transport whose library is missing raises HandoffUnavailable naming the pip package.
    """
    kind = Transport.parse(kind, "handoff transport")
    module_name, cls_name = _ENDPOINTS[kind].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(name, **options)
