"""The one place kvtier calls NIXL: an agent with the POSIX plugin (host memory <-> files).

Why a wrapper: every NIXL call (and its failure modes) lives here, so the backend's logic
(naming, verification, capacity) reads without NIXL details, and tests fake NIXL's answers
(errors, hangs) in one place.

NIXL facts this relies on (nixl 1.5.1 Python API):
- `nixl_agent(name, nixl_agent_config(backends=[]))` then `create_backend("POSIX", params)`:
  the agent constructor only warns about a missing plugin, `create_backend` raises.
- DRAM is registered as `(addr, len, dev_id=0, meta)`; a file as `(offset, len, fd, meta)`
  with mem type "FILE" (fd-mode: the caller owns the fd).
- A file transfer is a "remote" transfer to the agent itself: `initialize_xfer(op, dram
  xfer descs, file xfer descs, own name)`; transfer descs are `(addr|offset, len, dev|fd)`.
- `transfer` / `check_xfer_state` answer "DONE", "PROC" or "ERR"; `release_xfer_handle`
  raises when an unfinished transfer cannot be cancelled (POSIX cannot cancel).
- POSIX moves DRAM <-> FILE only, and its Linux AIO queue submits at most 64 I/Os per
  post, the rest from later `check_xfer_state` calls (so polling does the work on cached
  files), and counts a short read as success: callers check file sizes first and verify.
"""
from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from types import ModuleType
from typing import Sequence

import numpy as np

from kvtier.backends.base import PagesStillInUse, StorageUnavailable

log = logging.getLogger(__name__)

PLUGIN = "POSIX"
# NIXL's default I/O queue (Linux AIO). Measured here (256 pages x 2 x 737,280 B, page-cache
# hot): glibc POSIX AIO ({"use_posix_aio": "true"}) reads ~8 GB/s raw vs ~5 GB/s, because
# its helper threads copy on both cores; io_uring ({"use_uring": "true"}) ~ the default.
# The default keeps the copy in the calling thread, which a 2-core serving box can afford.
POSIX_PARAMS: dict[str, str] = {}
_IDS = itertools.count()
_FAST_POLL_S = 0.0005  # a poll that took longer than this did I/O itself: poll again at once
_MAX_SLEEP_S = 0.001


def nixl_api() -> ModuleType:
    """NIXL's Python API (`nixl._api`), with its log lines on stderr: NIXL logs through a
    handler of its own on stdout, which would mix its lines into the output of whatever runs
    kvtier (`kvtier bench ... --json`, a CLI's answer). Their level stays NIXL's
    (NIXL_LOG_LEVEL). Raises ImportError when nixl is not installed."""
    import nixl._api as api

    for handler in logging.getLogger("nixl").handlers:
        if type(handler) is logging.StreamHandler and handler.stream is not sys.stderr:
            handler.setStream(sys.stderr)
    return api


def wait_xfer(agent, handle, state: str, deadline: float, busy_s: float = _FAST_POLL_S,
              max_sleep_s: float = _MAX_SLEEP_S) -> str:
    """Poll a NIXL transfer until DONE/ERR or the deadline (bounded; never an endless spin).

    A poll that took longer than `busy_s` moved data itself: poll again at once; a poll that
    returned at once found nothing to do: sleep, doubling up to `max_sleep_s`."""
    sleep_s = 0.0
    while state == "PROC" and time.monotonic() <= deadline:
        if sleep_s:
            time.sleep(sleep_s)
        t0 = time.perf_counter()
        state = agent.check_xfer_state(handle)
        busy = time.perf_counter() - t0 > busy_s
        sleep_s = 0.0 if busy else min(max_sleep_s, max(2 * sleep_s, 2e-5))
    return state


def release_or_keep(agent, handle, stuck: list) -> bool:
    """Release a transfer handle (NIXL cancels a transfer still running); True when done.
    When NIXL refuses, the handle goes to `stuck`: the transfer may still touch the memory it
    names, which must then stay registered (and the handle alive) until exit."""
    try:
        agent.release_xfer_handle(handle)
        return True
    except Exception as exc:  # noqa: BLE001 - cannot cancel: keep it, say so
        log.warning("NIXL could not release a transfer handle (%s); keeping it", exc)
        stuck.append(handle)
        return False


class TransferTimeout(PagesStillInUse):
    """A NIXL transfer did not finish in time and could not be cancelled."""


class PosixAgent:
    """A NIXL agent with one POSIX backend; moves registered host memory to/from files.

    `transfer` is one NIXL request (a write batch, a chunk of a read batch): register the
    files, one initialize_xfer + transfer + bounded wait, release, deregister the files. It
    blocks: with the POSIX plugin the waiting thread does the copying, so a caller that
    wants other work done meanwhile does it on another thread (as the backend's reads do).
    """

    def __init__(self, params: dict[str, str] | None = None) -> None:
        try:
            api = nixl_api()
        except ImportError as exc:
            raise StorageUnavailable(
                f"the nixl package cannot be imported ({exc}); `pip install nixl` "
                "or choose another storage backend") from exc
        self.name = f"kvtier-nixl-{os.getpid()}-{next(_IDS)}"
        try:
            # No progress or listener thread: POSIX I/O needs neither, and no socket opens.
            config = api.nixl_agent_config(enable_prog_thread=False,
                                           enable_listen_thread=False, backends=[])
            self._agent = api.nixl_agent(self.name, config)
        except Exception as exc:
            raise StorageUnavailable(
                f"cannot create a NIXL agent ({exc}); check the nixl installation "
                "(NIXL_PLUGIN_DIR) or choose another backend") from exc
        plugins = self._agent.get_plugin_list()
        if PLUGIN not in plugins:
            raise StorageUnavailable(f"NIXL has no {PLUGIN} plugin (found {plugins}); install a "
                                     "nixl build with it or choose the file backend")
        try:
            self._agent.create_backend(PLUGIN, dict(POSIX_PARAMS if params is None else params))
        except Exception as exc:
            raise StorageUnavailable(
                f"cannot create NIXL's {PLUGIN} backend ({exc}); on Linux it needs libaio or "
                "io_uring; choose the file backend") from exc
        self._dram: list = []  # registrations to undo at close
        self._dram_ranges: set[tuple[int, int]] = set()
        self._stuck: list = []  # handles of transfers that timed out: kept alive, never freed
        self.closed = False

    # ---- memory ------------------------------------------------------------------------
    def register_dram(self, addr: int, nbytes: int) -> None:
        """Register host memory once; later transfers may name any range inside it."""
        if (addr, nbytes) in self._dram_ranges:
            return  # the same pool under a second name: NIXL already knows it
        try:
            reg = self._agent.register_memory([(addr, nbytes, 0, "")], "DRAM", backends=[PLUGIN])
        except Exception as exc:
            raise StorageUnavailable(
                f"NIXL cannot register {nbytes} bytes of host memory ({exc}); choose the file "
                "backend") from exc
        self._dram.append(reg)
        self._dram_ranges.add((addr, nbytes))

    # ---- transfers ---------------------------------------------------------------------
    def transfer(self, op: str, mem: Sequence[tuple[int, int]] | np.ndarray,
                 files: Sequence[tuple[int, int, int]] | np.ndarray, timeout_s: float) -> bool:
        """One NIXL request: `mem[i]` = (addr, len) <-> `files[i]` = (fd, offset, len), as
        sequences of tuples or uint64 arrays of 2 and 3 columns.

        op is "READ" (file -> memory) or "WRITE". Returns False when NIXL reports an error
        (the caller treats the batch as failed); raises TransferTimeout when the request is
        still running after `timeout_s` and cannot be cancelled.
        """
        assert op in ("READ", "WRITE") and len(mem) == len(files) and not self.closed
        if not len(mem):
            return True
        a = self._agent
        m = np.asarray(mem, dtype=np.uint64).reshape(-1, 2)  # columns: addr, len
        f = np.asarray(files, dtype=np.uint64).reshape(-1, 3)  # columns: fd, offset, len
        zeros = np.zeros(len(f), dtype=np.uint64)
        fd_rows = np.column_stack((zeros, f[:, 1] + f[:, 2], f[:, 0]))  # (0, file end, fd)
        try:
            file_reg = a.register_memory(fd_rows, "FILE", backends=[PLUGIN])
        except Exception as exc:
            log.warning("NIXL could not register %d files: %s", len(files), exc)
            return False
        try:
            local = a.get_xfer_descs(np.column_stack((m, zeros)), "DRAM")  # (addr, len, 0)
            remote = a.get_xfer_descs(np.ascontiguousarray(f[:, [1, 2, 0]]), "FILE")
            done = self._run(op, local, remote, timeout_s)
        except TransferTimeout:
            self._stuck.append(file_reg)  # in-flight I/O still refers to these files
            raise
        except Exception as exc:  # an unforeseen NIXL error fails this batch, not the cache
            log.warning("NIXL %s of %d objects failed: %s", op, len(files), exc)
            done = False
        a.deregister_memory(file_reg, backends=[PLUGIN])
        return done

    def _run(self, op: str, local, remote, timeout_s: float) -> bool:
        """initialize_xfer + transfer + bounded wait + release; True when DONE. The handle is
        released however the transfer ended (kept in `_stuck` when NIXL cannot cancel it)."""
        a = self._agent
        handle = a.initialize_xfer(op, local, remote, self.name, backends=[PLUGIN])
        try:
            state = self._wait(handle, a.transfer(handle), time.monotonic() + timeout_s)
        except Exception as exc:  # noqa: BLE001 - released below; NIXL cancels what it can
            log.warning("NIXL %s of %d objects raised: %s", op, local.descCount(), exc)
            state = "ERR"
        released = release_or_keep(a, handle, self._stuck)  # POSIX usually cannot cancel
        if state == "PROC" or not released:  # the kernel may still touch these pages
            how = f"did not finish in {timeout_s:.1f} s" if state == "PROC" else \
                f"ended ({state}) but NIXL could not release it"
            raise TransferTimeout(
                f"a NIXL {op} of {local.descCount()} objects {how}; the storage is too slow "
                "or hung: check the disk under root_dir, then restart")
        if state != "DONE":
            log.warning("NIXL %s of %d objects failed (%s)", op, local.descCount(), state)
        return state == "DONE"

    def _wait(self, handle, state: str, deadline: float) -> str:
        # With Linux AIO on cached files the poll itself submits the next I/Os: if it
        # worked for a while, poll again at once; if it returned at once, back off.
        return wait_xfer(self._agent, handle, state, deadline)

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Deregister host memory (idempotent). Stuck transfers keep their memory registered."""
        if self.closed:
            return
        self.closed = True
        if self._stuck:
            log.error("%d NIXL transfers never finished; leaving their memory registered",
                      len(self._stuck))
            return
        for reg in self._dram:
            try:
                self._agent.deregister_memory(reg, backends=[PLUGIN])
            except Exception as exc:  # closing must not fail; the process may exit anyway
                log.warning("NIXL deregistration failed: %s", exc)
        self._dram.clear()
