"""The body of the L3 namespace actor, without Ray: directory, persisted specs, Mooncake masters.

Methods take and return msgpack bytes of kvtier.messages records (or plain str/int/list),
so the Ray actor (actors/l3/namespace_actor.py) and the fake client serve the same object.

State that survives an actor restart: `<state_dir>/namespaces.json` lists every registered
NamespaceSpec, the epoch of each, and the pid/port of each Mooncake master this actor
started. A new incarnation re-registers each spec and rebuilds its directory from the
backend's listing (file, nixl, simulated). A Mooncake namespace starts empty (Mooncake cannot
list, and its objects lived in segments the old master managed): a master the old
incarnation left behind is killed, a new one started, and the epoch grows, so ranks know
from `info()` to re-attach; it binds the host the first one bound when the supervisor
restarts it, and on a new incarnation whatever `master_host` resolves to then. The
shared-root marker of a file or nixl namespace lives in its root_dir and is kept: a new
incarnation reads its token back. Leases do not survive: a prefetch whose pages are evicted
meanwhile reads a miss and recomputes.

Deletes never run under the lock that serializes directory calls: calls only mark what is
due, and the service's eviction thread (tiers/page_eviction) decides victims under the lock,
then deletes them outside it, so no lookup or report ever waits on a slow storage.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import tempfile
import threading
from operator import attrgetter
from typing import Callable, TypeVar

from kvtier.backends.mooncake_master import MooncakeMaster, default_master_host
from kvtier.backends.shared_root import ensure_marker, shared_root_dir
from kvtier.errors import KvtierError, PinRoomError
from kvtier.kv_spec import HeadRange
from kvtier.messages import (L2Forget, L2Listing, L2Report, LookupRequest, MissingReport, NamespaceInfo,
                             NamespaceSpec, PeerQuery, PeerRegistration, PinGrant, PinRequest,
                             StoredReport, pack_records)
from kvtier.policies import StorageBackendKind
from kvtier.storage_options import MooncakeOptions
from kvtier.tiers.page_directory import PageDirectory
from kvtier.tiers.page_eviction import PASS_INTERVAL_S, EvictionThread, PassResult

log = logging.getLogger(__name__)

STATE_FILE = "namespaces.json"
STATE_VERSION = 1
SUPERVISE_INTERVAL_S = 1.0
_T = TypeVar("_T")


class NamespaceService:
    """Namespaces, their page directory and the Mooncake masters started for them."""

    def __init__(self, state_dir: str | None = None, directory: PageDirectory | None = None,
                 supervise_interval_s: float = SUPERVISE_INTERVAL_S,
                 pass_interval_s: float = PASS_INTERVAL_S,
                 master_host: Callable[[MooncakeOptions], str] = default_master_host,
                 replica_num: Callable[[MooncakeOptions], int] = attrgetter("copies")
                 ) -> None:
        self.state_dir = state_dir  # None: nothing persists (tests of code using the client)
        self._master_host = master_host  # where a master binds (the actor: actors/l3/hosts)
        self._replica_num = replica_num  # copies of each object (the actor: actors/l3/hosts)
        self.directory = directory if directory is not None else PageDirectory()
        self.incarnation = secrets.token_hex(4)  # changes on every (re)start
        self._interval_s = supervise_interval_s
        self._lock = threading.RLock()  # the supervisor thread vs. calls
        self._specs: dict[str, NamespaceSpec] = {}
        self._masters: dict[str, MooncakeMaster] = {}
        self._epochs: dict[str, int] = {}
        self._unrestored: list[object] = []  # specs a restart could not open: kept, retried next
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._evictor = EvictionThread(self.directory, self._lock, pass_interval_s)
        with self._lock:
            self._restore()
            self._poke()

    # ---- namespaces -----------------------------------------------------------------------
    def register(self, spec_bytes: bytes) -> bytes:
        """Register (idempotent) and return NamespaceInfo bytes; a new namespace is rebuilt
        from its storage, so pages a persistent backend already holds are published."""
        spec = NamespaceSpec.from_msgpack(spec_bytes)
        with self._lock:
            if spec.namespace in self._specs:
                info = self.directory.register(spec)  # raises if the spec differs
                self._write_marker(spec, info.root_marker)  # again, if someone removed it
                return info.to_msgpack()
            info = self._open(spec)
            self.directory.rebuild(spec.namespace)
            self._poke()
            self._specs[spec.namespace] = spec
            self._unrestored = [raw for raw in self._unrestored
                                if not (isinstance(raw, dict) and raw.get("model") == spec.model
                                        and raw.get("tenant_salt", "") == spec.tenant_salt
                                        and raw.get("layout_fingerprint", "")
                                        == spec.layout_fingerprint)]
            self._save()
            return info.to_msgpack()

    def info(self, ns: str) -> bytes:
        with self._lock:
            return self.directory.info(ns).to_msgpack()

    def namespaces(self) -> list[str]:
        with self._lock:
            return self.directory.namespaces()

    def rebuild(self, ns: str) -> int:
        with self._lock:
            return self._poke(self.directory.rebuild(ns))

    def stats(self, ns: str) -> bytes:
        with self._lock:
            return self._poke(self.directory.stats(ns).to_msgpack())

    def purge(self, ns: str) -> int:
        """Empty namespace `ns`: its pages' deletes are queued (the eviction thread runs them),
        the directory starts over under a new epoch (persisted); returns the pages queued."""
        with self._lock:
            pages = self.directory.purge(ns)
            self._epochs[ns] = self.directory.info(ns).epoch
            self._save()
            return self._poke(pages)

    # ---- pages ----------------------------------------------------------------------------
    def report_stored(self, report_bytes: bytes) -> list[str]:
        r = StoredReport.from_msgpack(report_bytes)
        with self._lock:
            heads = HeadRange(r.head_start, r.head_stop,
                              self.directory.info(r.namespace).spec.kv_heads)
            return self._poke(self.directory.report_stored(r.namespace, r.hashes, heads))

    def report_missing(self, report_bytes: bytes) -> int:
        """A rank read published pages that were missing or corrupt: unpublish them."""
        r = MissingReport.from_msgpack(report_bytes)
        with self._lock:
            return self._poke(self.directory.report_missing(r.namespace, r.hashes))

    def lookup(self, request_bytes: bytes) -> bytes:
        q = LookupRequest.from_msgpack(request_bytes)
        with self._lock:
            return self._poke(
                self.directory.lookup(q.namespace, q.hashes, q.lease_ttl_s).to_msgpack())

    def lease(self, request_bytes: bytes) -> bytes:
        q = LookupRequest.from_msgpack(request_bytes)
        with self._lock:
            return self._poke(
                self.directory.lease(q.namespace, q.hashes, q.lease_ttl_s).to_msgpack())

    def release(self, lease_id: str) -> bool:
        with self._lock:
            return self._poke(self.directory.release(str(lease_id)))

    # ---- L2 holdings (the directory's l2_holders) --------------------------------------------
    def report_l2(self, report_bytes: bytes) -> bytes:
        """An instance's L2 changes (an L2Report; empty: a renewal of its lease): L2Receipt
        bytes."""
        r = L2Report.from_msgpack(report_bytes)
        with self._lock:
            return self.directory.report_l2(r.namespace, r.holder, r.incarnation, r.held,
                                            r.dropped, r.replace).to_msgpack()

    def forget_l2(self, forget_bytes: bytes) -> int:
        """An instance's incarnation stopped (an L2Forget): it holds nothing in L2 any more."""
        f = L2Forget.from_msgpack(forget_bytes)
        with self._lock:
            return self.directory.forget_l2(f.holder, f.incarnation)

    def l2_holders(self, request_bytes: bytes) -> bytes:
        """Who holds a leading run of the pages of a LookupRequest in L2: L2Listing bytes."""
        q = LookupRequest.from_msgpack(request_bytes)
        with self._lock:
            return L2Listing(q.namespace, self.directory.l2_holders(q.namespace,
                                                                    q.hashes)).to_msgpack()

    # ---- peers (L2 lent to other instances: the directory's l2_holders) ---------------------
    def register_peer(self, registration_bytes: bytes) -> None:
        """A holder's rank lends its L2 pages to peers (a PeerRegistration)."""
        r = PeerRegistration.from_msgpack(registration_bytes)
        with self._lock:
            self.directory.register_peer(r.namespace, r.holder, r.incarnation, r.rank)

    def best_peer(self, query_bytes: bytes) -> bytes:
        """The peer holding the longest leading run of a PeerQuery's pages: PeerOffer bytes."""
        q = PeerQuery.from_msgpack(query_bytes)
        with self._lock:
            return self.directory.best_peer(q.namespace, q.hashes, q.asker).to_msgpack()

    # ---- pinned prefixes (the directory's page_pins) -----------------------------------------
    def pin(self, request_bytes: bytes) -> bytes:
        """Pin a prefix's published pages: PinGrant bytes (a refusal is a value, not an
        error, so it crosses the actor boundary as one)."""
        q = PinRequest.from_msgpack(request_bytes)
        with self._lock:
            try:
                pages = self.directory.pin(q.namespace, q.pin_id, q.hashes, q.ttl_s,
                                           q.max_fraction, q.tenant)
            except PinRoomError as exc:
                return PinGrant(q.namespace, q.pin_id, 0, str(exc), exc.needed_pages,
                                exc.free_pages).to_msgpack()
            return self._poke(PinGrant(q.namespace, q.pin_id, pages).to_msgpack())

    def unpin(self, ns: str, pin_id: str) -> bool:
        with self._lock:
            return self._poke(self.directory.unpin(str(ns), str(pin_id)))

    def refresh_pins(self, ns: str, pin_ids: list[str]) -> int:
        with self._lock:
            return self._poke(self.directory.refresh_pins(str(ns), [str(i) for i in pin_ids]))

    def pins(self, ns: str) -> bytes:
        """The namespace's pins: L3PinListing records (`pack_records`)."""
        with self._lock:  # (lapsing pins may leave the namespace over its quota: a pass)
            return self._poke(pack_records(self.directory.pins(str(ns))))

    # ---- eviction -------------------------------------------------------------------------
    def run_pass(self) -> PassResult:
        """One eviction pass now, in the calling thread (deletes outside the lock): what the
        background thread does; in-process users call it to converge deterministically."""
        return self._evictor.run_now()

    def wait_for_pass(self, timeout_s: float = 30.0) -> bool:
        """Wait until a background pass that starts after this call has finished."""
        return self._evictor.wait_next_pass(timeout_s)

    def _poke(self, result: _T = None) -> _T:  # type: ignore[assignment]
        """Wake the eviction thread when the directory has work for it; returns `result`.
        Called with the lock held, right after each directory call."""
        if self.directory.pass_due:
            self._evictor.wake()
        return result

    # ---- lifetime -------------------------------------------------------------------------
    def ping(self) -> str:
        return self.incarnation

    def supervise(self) -> int:
        """Restart Mooncake masters that died (new ports, new epoch); returns how many."""
        restarted = 0
        with self._lock:
            for ns, master in list(self._masters.items()):
                if master.alive():
                    continue
                log.error("L3 namespace %s: its Mooncake master (pid %d) exited; restarting it",
                          ns, master.pid)
                master.stop()
                try:
                    new = MooncakeMaster(self._specs[ns].storage_options().start_timeout_s,
                                         host=master.host)  # the same address, new ports
                except KvtierError as exc:
                    log.error("L3 namespace %s: cannot restart its Mooncake master (%s); "
                              "retrying in %.1f s", ns, exc, self._interval_s)
                    continue
                try:
                    options = dict(self.directory.info(ns).options, master_address=new.address)
                    self._epochs[ns] = self.directory.reattach(ns, options).epoch
                except KvtierError as exc:
                    new.stop()  # the next round starts another one
                    log.error("L3 namespace %s: cannot attach to its new Mooncake master (%s)",
                              ns, exc)
                    continue
                self._masters[ns] = new
                restarted += 1
            if restarted:
                self._save()
        return restarted

    def masters(self) -> dict[str, int]:
        """The process id of each live Mooncake master this incarnation started, by
        namespace (on the actor's node: fault injection and operators)."""
        with self._lock:
            return {ns: m.pid for ns, m in self._masters.items() if m.alive()}

    def close(self) -> None:
        """Stop supervising and evicting, close the directory's clients, stop the masters
        (specs stay). Deletes still queued are dropped: a rebuild lists their objects."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self._interval_s + 5)
        self._evictor.close()
        with self._lock:
            self.directory.close()
            for master in self._masters.values():
                master.stop()
            self._masters.clear()
            self._save()

    def __enter__(self) -> "NamespaceService":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------
    def _open(self, spec: NamespaceSpec, epoch: int = 0) -> NamespaceInfo:
        """Start a master if the namespace needs one of ours, then register the directory."""
        options = dict(spec.options)
        master = None
        marker = self._write_marker(spec)
        if spec.backend is StorageBackendKind.MOONCAKE:  # "auto" resolved for the ranks
            options["replica_num"] = self._replica_num(spec.storage_options())
        if spec.backend is StorageBackendKind.MOONCAKE and options.get("master_address") is None:
            opts = spec.storage_options()
            assert isinstance(opts, MooncakeOptions)
            master = MooncakeMaster(opts.start_timeout_s, host=self._master_host(opts))
            options["master_address"] = master.address
            options.pop("master_host", None)  # in master_address now (both would conflict)
            epoch += 1  # new storage: ranks of an earlier epoch must re-attach
        try:
            info = self.directory.register(spec, options, epoch, marker)
        except BaseException:
            if master is not None:
                master.stop()
            raise
        if master is not None:
            self._masters[spec.namespace] = master
            self._start_supervisor()
        self._epochs[spec.namespace] = info.epoch
        return info

    def _write_marker(self, spec: NamespaceSpec, token: str = "") -> str:
        """The token of the namespace's shared-root marker (file, nixl: written if absent,
        kept if there: backends/shared_root.py); "" for backends without a root."""
        root_dir = shared_root_dir(spec.storage_options())
        return "" if root_dir is None else ensure_marker(root_dir, spec.namespace, token)

    def _start_supervisor(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._supervise_loop, daemon=True,
                                            name="kvtier-l3-supervisor")
            self._thread.start()

    def _supervise_loop(self) -> None:
        while not self._stop.wait(self._interval_s):  # bounded: close() sets the event
            try:
                self.supervise()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad round
                log.exception("L3 namespace supervisor round failed")

    def _restore(self) -> None:
        """Re-register what an earlier incarnation registered (see the module docstring)."""
        state = _load(self.state_dir)
        for entry in state.get("masters", {}).values():
            _kill_stale_master(entry)
        epochs = state.get("epochs", {})
        for raw in state.get("namespaces", []):
            if isinstance(raw, dict) and "tp_size" in raw:  # format 1: objects named by rank
                log.warning("L3 namespace of %r from %s dropped: it is of the old object format "
                            "(by TP rank), never read again; a namespace of the model registered "
                            "now reclaims its objects", raw.get("model"), STATE_FILE)
                continue
            try:
                spec = NamespaceSpec.from_map(raw)
                epoch = epochs.get(spec.namespace, 0)
                self._open(spec, epoch if isinstance(epoch, int) else 0)
                self._specs[spec.namespace] = spec
                self.directory.rebuild(spec.namespace)
            except (KvtierError, ValueError) as exc:
                self._unrestored.append(raw)
                log.error("L3 namespace from %s not restored (%s); register it again", STATE_FILE,
                          exc)
        if state:
            log.info("L3 namespace actor restored %d namespaces from %s", len(self._specs),
                     self.state_dir)
        self._save()

    def _save(self) -> None:
        if self.state_dir is None:
            return
        state = {"version": STATE_VERSION,
                 "namespaces": [spec.to_map() for spec in self._specs.values()] + self._unrestored,
                 "epochs": self._epochs,
                 "masters": {ns: {"pid": m.pid, "rpc_port": m.rpc_port}
                             for ns, m in self._masters.items() if m.alive()}}
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".namespaces-", dir=self.state_dir)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, os.path.join(self.state_dir, STATE_FILE))  # atomic: old or new, never torn


def _load(state_dir: str | None) -> dict:
    if state_dir is None:
        return {}
    path = os.path.join(state_dir, STATE_FILE)
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.error("cannot read %s (%s); starting with no namespaces: register them again", path,
                  exc)
        return {}
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        log.error("%s is not a version-%d state file; starting with no namespaces", path,
                  STATE_VERSION)
        return {}
    return state


def _kill_stale_master(entry: object) -> None:
    """A master the previous incarnation started outlives it (SIGKILL runs no cleanup)."""
    if not isinstance(entry, dict):
        return
    pid, port = entry.get("pid"), entry.get("rpc_port")
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")
    except (OSError, TypeError, ValueError):
        return  # gone already
    if any(arg.endswith(b"mooncake_master") for arg in cmdline[:1]) and \
            f"--rpc_port={port}".encode() in cmdline:
        log.warning("stopping the Mooncake master (pid %s) of an earlier incarnation", pid)
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
