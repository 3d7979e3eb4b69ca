"""The local TP launcher the tests use: `run_tp(fn, size, *args)` runs `fn(tp, *args)` in one
spawned process per rank (each joins its group with kvtier.engine.tp_group.init_tp) and
returns the results by rank. The Ray rank actors (kvtier.actors.rank_actor) are what runs a
TP group in production.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from kvtier.engine.model_config import ModelConfig
from kvtier.engine.parallel import TensorParallel
from kvtier.engine.tp_group import (DEFAULT_TIMEOUT_S, choose_backend, destroy_tp, init_tp,
                                    loopback_init_method)
from kvtier.errors import ConfigError, KvtierError

log = logging.getLogger(__name__)

_STOP_GRACE_S = 3.0      # SIGTERM, then SIGKILL after this long
_ERROR_GRACE_S = 0.5     # after the first failure, how long to gather the other ranks' errors


class TPRunError(KvtierError, RuntimeError):
    """A TP rank failed, died or ran past the timeout. `rank` is the first failing rank (None
    on a timeout), `remote_traceback` its traceback text, `pids` the rank processes (all
    stopped by the time this is raised)."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = "",
                 pids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.rank, self.remote_traceback, self.pids = rank, remote_traceback, pids


def _rank_main(rank: int, size: int, init_method: str, backend: str, timeout_s: float,
               log_level: int, fn: Callable[..., Any], args: tuple, conn: Connection) -> None:
    """A rank process: join, run `fn`, send ("ok", result) or ("error", traceback text)."""
    torch.set_num_threads(1)  # ranks share the machine's cores: one thread each, no thrashing
    torch.set_num_interop_threads(1)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s tp{rank}/{size} %(name)s %(levelname)s %(message)s")
    ok = False
    try:
        try:
            tp = init_tp(rank, size, init_method, backend=backend, timeout_s=timeout_s)
            result = fn(tp, *args)
            if dist.is_initialized():  # unless `fn` left the group itself
                dist.barrier()  # rank 0 hosts the store: none tears down while others work
            conn.send(("ok", result))
            ok = True
        except BaseException:  # noqa: BLE001 - every failure goes back to the launcher as text
            # Sent before leaving the group, so it reaches the launcher ahead of the errors
            # our departure causes in the other ranks: the first error is the cause.
            conn.send(("error", traceback.format_exc()))
        destroy_tp()
    finally:
        conn.close()
        # Nothing is left to clean up (group destroyed, result sent), and a normal interpreter
        # exit with torch loaded takes 0.5-1 s per rank: leave at once.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if ok else 1)


def _stop(procs: list[Any], exit_wait_s: float) -> None:
    """Reap every rank process: wait up to `exit_wait_s` for them to exit on their own (after
    sending their results), then SIGTERM, then SIGKILL the ones that ignore it."""
    deadline = time.monotonic() + exit_wait_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            log.warning("TP rank process %s ignored SIGTERM; killing it", proc.pid)
            proc.kill()
            proc.join()


def run_tp(fn: Callable[..., Any], size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
           backend: str | None = None, init_method: str | None = None,
           config: ModelConfig | None = None) -> list[Any]:
    """Run `fn(tp, *args)` in `size` fresh processes, one per TP rank; results by rank.

    `fn` and `args` must pickle (a module-level function); results should be plain Python
    values. With `config`, a TP size that does not split it is a ConfigError before any
    process starts. Raises TPRunError naming the rank (with its traceback) when a rank fails
    or dies, or when `timeout_s` passes; every rank process is stopped before returning.
    """
    if size < 1:
        raise ConfigError(f"TP size must be >= 1, got {size}")
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
    if config is not None:
        TensorParallel(0, size).check(config)
    backend = backend or choose_backend(size)
    init_method = init_method or loopback_init_method()
    ctx = tmp.get_context("spawn")  # fork would copy torch's threads and locks mid-state
    procs: list[Any] = []
    conns: dict[Connection, int] = {}
    start = time.monotonic()
    results: dict[int, Any] | None = None
    try:
        for rank in range(size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, name=f"kvtier-tp{rank}", daemon=True,
                               args=(rank, size, init_method, backend, timeout_s,
                                     logging.getLogger().getEffectiveLevel(), fn, args, send))
            proc.start()
            send.close()  # keep only the child's end open: its exit then reads as EOF here
            procs.append(proc)
            conns[recv] = rank
        results = _collect(conns, procs, start + timeout_s, timeout_s)
    finally:
        # A failed run stops at once: its other ranks may sit in a collective for good.
        _stop(procs, _STOP_GRACE_S if results is not None else 0.0)
        for conn in conns:
            conn.close()
    log.info("TP run of %s on %d ranks (%s) took %.2f s", getattr(fn, "__name__", fn), size,
             backend, time.monotonic() - start)
    return [results[rank] for rank in range(size)]


def _collect(conns: dict[Connection, int], procs: list[Any], deadline: float,
             timeout_s: float) -> dict[int, Any]:
    """Every rank's result, or TPRunError for the first rank that failed."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pending = dict(conns)
    pids = tuple(p.pid for p in procs)
    while pending:
        now = time.monotonic()
        if errors:
            deadline = min(deadline, now + _ERROR_GRACE_S)
        if now >= deadline:
            break
        for conn in wait(list(pending), timeout=deadline - now):
            rank = pending.pop(conn)
            try:
                status, payload = conn.recv()
            except EOFError:
                status, payload = "error", (f"rank {rank} exited with code "
                                            f"{_exitcode(procs[rank])} without a result "
                                            f"(killed, out of memory, or os._exit)")
            if status == "ok":
                results[rank] = payload
            else:
                errors[rank] = payload
    if errors:
        first = next(iter(errors))  # in arrival order: later ones are usually the fallout
        others = "".join(f"\n  rank {r}: {tb.strip().splitlines()[-1]}"
                         for r, tb in errors.items() if r != first)
        raise TPRunError(f"TP rank {first} of {len(procs)} failed; its traceback:\n"
                         f"{errors[first].rstrip()}"
                         + (f"\nother ranks failed too:{others}" if others else ""),
                         first, errors[first], pids)
    if pending:
        late = sorted(pending.values())
        raise TPRunError(f"TP ranks {late} of {len(procs)} did not finish within {timeout_s} s; "
                         f"raise timeout_s if the work is just slow, else look for a rank "
                         f"stuck in a collective the others skipped", None, "", pids)
    return results


def _exitcode(proc: Any) -> int | None:
    proc.join(1.0)  # the pipe closes a moment before the process is reaped
    return proc.exitcode
