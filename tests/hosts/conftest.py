"""Host-harness tests: network namespaces on a private bridge (root and `ip` needed; the
tests skip with the reason otherwise). test_cluster and test_serve_hosts share one 3-host Ray
cluster (`hosts_cluster`: starting one is the costliest step of either); the other modules
make networks of their own."""
from __future__ import annotations

import pytest

from kvtier.hosts.network import why_unavailable

_WHY = why_unavailable()


def pytest_collection_modifyitems(config, items):
    if _WHY is None:
        return
    skip = pytest.mark.skip(reason=f"host harness unavailable: {_WHY}")
    for item in items:
        if "tests/hosts/" in str(item.fspath):
            item.add_marker(skip)


# A killed raylet is declared dead after ~3 s of failed health checks instead of Ray's ~15 s.
# A cut link is not: each check waits up to health_check_timeout_ms (10 s) for its answer,
# and the one in flight during test_serve_hosts' 5 s cut gets it once the link is back.
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000",
                   "RAY_health_check_failure_threshold": "3",
                   "RAY_health_check_timeout_ms": "10000"}


@pytest.fixture(scope="session")
def hosts_cluster():
    """Three hosts, token auth on: the head (kvtier_head) on host 1; hosts 2 and 3 each offer
    one TP=2 instance (kvtier_instance 2, 2 CPUs), so `kvtier serve --instances 2 --tp 2`
    puts one instance on each."""
    from kvtier.cli.demo_hosts import HostsRun

    with HostsRun(3, tp_size=2, instances_per_host=1, head_env=FAST_NODE_DEATH) as run:
        yield run
