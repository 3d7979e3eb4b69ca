"""A serve deployment's prefill/decode disaggregation settings, checked together.

`--prefill-instances P --decode-instances D` (both, or neither) make a prefill/decode graph
of P + D instances in place of `--instances`; `--pd-transport` says how the prompt's KV goes
from a prefill instance to a decode instance, and is only for such a graph.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from kvtier.errors import ConfigError
from kvtier.policies import Transport


class PDGraph(NamedTuple):
    instances: int  # every model replica: P + D in a prefill/decode graph
    transport: Transport | None  # None: not a prefill/decode graph


def _where(name: str) -> str:
    """A setting as a Serve config and the command line spell it."""
    return f"{name} (--{name.replace('_', '-')})"


def _count(value: Any, name: str, most: int, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{_where(name)}: expected an integer, got {value!r}")
    if not least <= value <= most:  # a PD count of 0: not given
        raise ConfigError(f"{_where(name)} {value}: give 1 to {most}")
    return value


def pd_graph(instances: Any, prefill: Any, decode: Any, transport: Any, default_instances: int,
             most: int) -> PDGraph:
    """The instance count and hand-off transport of these settings (`instances` None and PD
    counts of 0: not given);
    a ConfigError naming the setting and its flag for a count out of range, one of the PD
    counts without the other, `instances` other than P + D beside them, or a transport
    without them."""
    n = None if instances is None else _count(instances, "instances", most, least=1)
    p = _count(prefill, "prefill_instances", most)
    d = _count(decode, "decode_instances", most)
    if bool(p) != bool(d):
        given, missing = ("prefill", "decode") if p else ("decode", "prefill")
        raise ConfigError(f"{_where(given + '_instances')} {p or d} without "
                          f"{_where(missing + '_instances')}: a prefill/decode graph needs "
                          f"both, each at least 1; give both, or neither for instances that "
                          f"each prefill and decode")
    if not p:
        if transport is not None:
            raise ConfigError(f"{_where('pd_transport')} {transport!s} is only for a "
                              f"prefill/decode graph: add --prefill-instances and "
                              f"--decode-instances, or drop it")
        return PDGraph(n or default_instances, None)
    if n not in (None, p + d):
        raise ConfigError(f"{_where('instances')} {n} conflicts with prefill_instances {p} + "
                          f"decode_instances {d}: a prefill/decode graph has those instead; "
                          f"drop --instances (or give --instances {p + d})")
    if p + d > most:
        raise ConfigError(f"prefill_instances {p} + decode_instances {d} is more than {most} "
                          f"instances; give fewer")
    return PDGraph(p + d, Transport.parse_across(Transport.NIXL if transport is None
                                                 else transport, _where("pd_transport")))
