"""`kvtier demo --hosts 3` (root): the demo on three hosts of this machine.

The host harness makes three network namespaces on a private bridge (kvtier.hosts), each
with a /tmp of its own; Ray runs across them with token auth on: host 1 is the head (the L3
namespace actor and the Mooncake master it starts, custom resource `kvtier_head`), instance
A runs on host 2, instance B and the cold reference on host 3. The demo's driver runs inside
host 1 and joins that cluster (`kvtier demo --address ... --place ...`); a `file` or `nixl`
L3 lives in a directory every host mounts. The report is the demo's, plus
`bytes_across_hosts`: what the hosts sent each other over the bridge during the run.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Sequence

from kvtier.errors import ConfigError

HOSTS = 3
WORK_BASE = "/var/tmp"  # not /tmp: every host sees it (each host's /tmp is its own)


class HostsRun:
    """Three hosts and a Ray cluster over them; `close()` stops every process by PID and
    deletes the namespaces and the work directory."""

    def __init__(self, hosts: int = HOSTS, tp_size: int = 3, instances_per_host: int = 2,
                 head_env: dict[str, str] | None = None) -> None:
        """Worker hosts offer `kvtier_instance` (and CPUs) for `instances_per_host`
        instances of `tp_size` ranks each; `head_env`: Ray settings of the head."""
        from kvtier.actors.rank_actor import RANK_NUM_CPUS
        from kvtier.hosts.network import HostNetwork
        from kvtier.hosts.ray_nodes import RayHosts, private_tmp

        if hosts != HOSTS:
            raise ConfigError(f"--hosts must be {HOSTS} (head, instance A, instance B), got "
                              f"{hosts}")
        self.workdir = tempfile.mkdtemp(prefix="kvtier-hosts-", dir=WORK_BASE)
        self.net = HostNetwork.up(hosts, private_tmp(self.workdir, hosts))
        try:
            self.ray = RayHosts(self.net, f"{self.workdir}/ray")
            # the demo's host 3 holds B and the cold reference: two instances
            ranks = instances_per_host * tp_size
            cpus = max(2, round(ranks * RANK_NUM_CPUS + 0.49))
            self.ray.start(head_resources={"kvtier_head": 1},
                           worker_resources={"kvtier_instance": ranks}, worker_cpus=cpus,
                           head_env=head_env)
        except BaseException:
            self.close()
            raise

    @property
    def shared_dir(self) -> str:
        return f"{self.workdir}/shared"

    def placement(self) -> dict[str, str]:
        """Instance name -> the address of the host it runs on."""
        h = self.net.hosts
        return {"A": h[1].address, "B": h[2].address, "cold": h[2].address}

    def close(self) -> None:
        self.net.down()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "HostsRun":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def inner_args(params: Any, run: HostsRun) -> list[str]:
    """The `kvtier demo` command line the driver runs inside host 1."""
    args = ["-m", "kvtier", "demo", "--address", run.ray.address, "--l3", params.l3,
            "--tokens", str(params.tokens), "--new-tokens", str(params.new_tokens),
            "--tp", str(params.tp_size), "--dtype", params.dtype]
    if params.l3 in ("file", "nixl"):
        args += ["--l3-root", f"{run.shared_dir}/l3"]
    args += _model_and_cache_args(params, run)
    for name, address in run.placement().items():
        args += ["--place", f"{name}={address}"]
    if not params.progress:
        args.append("--json-only")
    return args


def _model_and_cache_args(params: Any, run: HostsRun) -> list[str]:
    """--model, --page-size and the other cache knobs (as a --hicache-config file in the
    work directory, which every host sees) where they are not the demo's defaults."""
    from kvtier.cli.demo_flags import DEFAULT_MODEL, DEFAULT_PAGE_SIZE

    args = [] if params.model == DEFAULT_MODEL else ["--model", params.model]
    if params.page_size != DEFAULT_PAGE_SIZE:
        args += ["--page-size", str(params.page_size)]
    if params.hicache:
        path = f"{run.workdir}/hicache.json"
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(dict(params.hicache), fh)
        args += ["--hicache-config", f"@{path}"]
    return args


def run_on_hosts(params: Any, extra: Sequence[str] = (), ceilings: bool = False
                 ) -> tuple[dict, str]:
    """Run the demo on three new hosts; its JSON summary and the text it printed before
    the JSON line. `ceilings`: also measure, between the same hosts, a plain TCP stream and
    Mooncake's own reads of what B read from L3."""
    with HostsRun(HOSTS, params.tp_size) as run:
        result, text = run_demo(run, params, extra)
        if ceilings:
            result.update(measure_ceilings(run, result))
        return result, text


def run_demo(run: HostsRun, params: Any, extra: Sequence[str] = ()) -> tuple[dict, str]:
    """The demo's driver inside host 1 of `run`; its summary plus `bytes_across_hosts` (and
    per host), `hosts`, `placement` and `ttft_l3_cross_host_ratio`."""
    before = run.net.bytes_sent()
    proc = run.ray.driver_popen([*inner_args(params, run), *extra],
                                stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=3600)
    sent = {h: n - before[h] for h, n in run.net.bytes_sent().items()}
    lines = out.rstrip().splitlines()
    if proc.returncode not in (0, 1) or not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"the demo's driver in host 1 exited {proc.returncode}:\n"
                           f"{out[-4000:]}")
    result = json.loads(lines[-1])
    result["bytes_across_hosts"] = sum(sent.values())
    result["bytes_sent_by_host"] = sent
    result["hosts"] = {h.name: h.address for h in run.net.hosts}
    result["placement"] = run.placement()
    result["ttft_l3_cross_host_ratio"] = result.get("ttft_l3_cross_instance_ratio")
    return result, "\n".join(lines[:-1])


def measure_ceilings(run: HostsRun, result: dict) -> dict:
    """`raw_tcp_gbps` (host 2 -> host 3) and `raw_mooncake_read_gbps`: a client on host 3
    reading, with one reader per TP rank, the objects B read from L3 (same count and size),
    stored by a client on host 2 under a master on host 1. Per-object figures of both reads
    (`raw_mooncake_read`, `l3_read`: objects, bytes per object, objects/s; the raw one's
    calls, one `batch_get_into` per reader)."""
    from kvtier.bench.host_ceilings import mooncake_read_gbps, tcp_gbps

    h1, h2, h3 = run.net.hosts
    out = {"raw_tcp_gbps": round(tcp_gbps(h2, h3), 3)}
    l3 = [r for r in result["requests"] if r.get("l3_read_bytes")]
    if l3:
        tp = result["tp_size"]
        objects = 2 * tp * l3[0]["cached"]["storage"] // result["page_size"]  # k and v parts
        object_bytes = l3[0]["l3_read_bytes"] // objects
        raw = mooncake_read_gbps(h1, h2, h3, object_bytes, objects, readers=tp)
        out["raw_mooncake_read_gbps"] = round(raw.gbps, 3)
        raw_s = objects * object_bytes / (raw.gbps * 1e9)
        out["raw_mooncake_read"] = {"objects": objects, "object_bytes": object_bytes,
                                    "calls_per_batch": tp, "objects_per_s": round(objects / raw_s)}
        # kvtier's side of the same read: every rank's objects over the longest rank's time
        seconds = l3[0].get("l3_read_s") or 0
        out["l3_read"] = {"objects": objects, "object_bytes": object_bytes,
                          "objects_per_s": round(objects / seconds) if seconds > 0 else None}
        if result.get("l3_read_gbps"):
            out["l3_read_vs_raw_mooncake"] = round(result["l3_read_gbps"] / raw.gbps, 3)
    return out


def main(params: Any) -> int:
    result, text = run_on_hosts(params)
    if text:
        print(text)
    print(json.dumps(result))
    sys.stdout.flush()
    return 0 if result.get("identical") else 1
