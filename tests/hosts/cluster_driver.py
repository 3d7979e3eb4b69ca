"""A Ray driver that runs inside host 1 of the harness and does what the test process tells
it, one JSON command per stdin line, one JSON answer per stdout line (prefixed `@@ `; Ray's
own output goes elsewhere). It joins the cluster with the token (auth on) and drives kvtier's
namespace actor and instances (the tiny model) on the cluster's hosts.

Commands (`op` and its fields):
  namespace  backend, root               register an L3 namespace (actor on kvtier_head)
  instance   name, tp, node | None       an Instance, its ranks on that node (or anywhere
                                         that offers kvtier_instance)
  generate   name, prompt                greedy answer: tokens, cached {device, host, storage}
  start      name, prompt                the same in a background thread ...
  join       name                        ... and its answer
  quiesce    name
  drop       name                        close the instance (its CPUs are free again)
  where      name                        the node address of each rank
  stats      name                        restarts, L3 counters of rank 0
  pids                                   this driver's pid
  close
"""
from __future__ import annotations

import json
import sys
import threading
import traceback
import uuid

import torch

from kvtier.actors.ray_join import join_cluster

join_cluster("auto")

import ray  # noqa: E402
import ray._private.state as ray_state  # noqa: E402

from kvtier.actors.instance import Instance  # noqa: E402
from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor  # noqa: E402
from kvtier.actors.rank_actor import RankSettings  # noqa: E402
from kvtier.config import HiCacheConfig  # noqa: E402
from kvtier.cli.demo import namespace_spec  # noqa: E402
from kvtier.engine.sampling import SamplingParams  # noqa: E402
from kvtier.engine.weight_sources import TinyWeights  # noqa: E402

PAGE = 16
CONFIG = HiCacheConfig(page_size=PAGE, prefetch_policy="wait_complete",
                       prefetch_threshold_tokens=PAGE)
SETTINGS = RankSettings(TinyWeights(seed=5), CONFIG, device_pages=48, dtype=torch.float32,
                        chunk_tokens=PAGE, timeout_s=30.0)
GREEDY = SamplingParams(max_new_tokens=6)


class Driver:
    def __init__(self) -> None:
        self.client = None
        self.actor_name = f"kvtier-l3-hosts-{uuid.uuid4().hex[:6]}"
        self.info = None
        self.instances: dict[str, Instance] = {}
        self.threads: dict[str, tuple[threading.Thread, dict]] = {}

    def namespace(self, backend: str, root: str = "", tp: int = 2) -> dict:
        if self.client is None:
            self.client = get_or_create_namespace_actor(
                self.actor_name, f"/tmp/{self.actor_name}-state", resources={"kvtier_head": 1})
        self.info = self.client.register(namespace_spec(
            SETTINGS.source, CONFIG, backend, root, "tiny", uuid.uuid4().hex[:8],
            dtype=SETTINGS.dtype, page_size=PAGE, tp_size=tp))
        return {"namespace": self.info.namespace, "options": dict(self.info.spec.options)}

    def instance(self, name: str, tp: int = 2, node: str | None = None) -> dict:
        resources = {f"node:{node}": 0.01} if node else {"kvtier_instance": 1}
        settings = SETTINGS._replace(l3=self.info, l3_actor=self.actor_name)
        self.instances[name] = Instance(settings, tp_size=tp, resources=resources,
                                        ready_timeout_s=120, step_timeout_s=30)
        return self.where(name)

    def generate(self, name: str, prompt: list[int]) -> dict:
        out = self.instances[name].generate([prompt], GREEDY)[0]
        return {"tokens": list(out.tokens), "cached": out.cached._asdict()}

    def start(self, name: str, prompt: list[int]) -> dict:
        box: dict = {}

        def run() -> None:
            try:
                box["result"] = self.generate(name, prompt)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                box["error"] = f"{type(exc).__name__}: {exc}"

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads[name] = (t, box)
        return {"started": name}

    def join(self, name: str, timeout_s: float = 300) -> dict:
        t, box = self.threads.pop(name)
        t.join(timeout_s)
        if t.is_alive():
            return {"error": f"{name} did not answer within {timeout_s} s"}
        return box

    def drop(self, name: str) -> dict:
        self.instances.pop(name).close()
        return {}

    def quiesce(self, name: str) -> dict:
        self.instances[name].quiesce()
        return {}

    def where(self, name: str) -> dict:
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        ids = [ray_state.actors(r._actor_id.hex())["Address"]["NodeID"]
               for r in self.instances[name].ranks]
        return {"nodes": [nodes.get(i, i) for i in ids]}

    def stats(self, name: str) -> dict:
        inst = self.instances[name]
        snap = inst.cache_snapshot()[0]
        return {"restarts": inst.restarts, "storage": snap.storage}

    def pids(self) -> dict:
        import os

        return {"pid": os.getpid()}

    def close(self) -> dict:
        for inst in self.instances.values():
            inst.close()
        if self.client is not None:
            self.client.shutdown()
        return {}


def main() -> None:
    driver = Driver()
    print("@@ " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            answer = {"ok": getattr(driver, op)(**cmd)}
        except Exception as exc:  # noqa: BLE001 - the test reads the error
            answer = {"error": f"{type(exc).__name__}: {exc}",
                      "trace": traceback.format_exc()[-3000:]}
        print("@@ " + json.dumps(answer), flush=True)
        if op == "close":
            break
    ray.shutdown()


if __name__ == "__main__":
    main()
