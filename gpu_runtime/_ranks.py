"""A group of N rank processes over a real ``torch.distributed`` process group, started and torn down here.

What a multi-rank runtime (``kvproof.gpu_runtime.tp_prefetch``) or an adapter of a real engine's ranks runs on:

* **the processes**: ``N`` fresh interpreters (``python -m kvproof.gpu_runtime._ranks``: no forked torch state,
  no re-import of the caller's ``__main__``), connected to the parent over a private Unix socket, each with its
  own *worker* object (``module:Class``, built in the rank after the process group is up). The parent sends a
  command to every rank at once and collects each rank's reply;
* **the process group**: gloo on loopback (``GLOO_SOCKET_IFNAME=lo``), or NCCL when at least ``N`` CUDA devices are
  present. Rank 0 opens a ``TCPStore`` on port 0 (the kernel picks a free port, no race) and the parent hands the
  port to the other ranks. Every collective has the group's timeout (``collective_timeout``);
* **the collectives, observed**: inside a command, every ``torch.distributed.all_reduce`` a rank's main thread calls
  is reported to the parent *before* it runs (its op and values, named by the worker through :func:`naming`), and
  its result or error after. A rank that hangs in a collective is still described: its call was reported first;
* **bounded**: the parent waits at most ``collective_timeout + grace`` per collective a command can make (it never
  blocks forever). A rank that errs, hangs past the bound or dies makes the group *broken*: it is torn down at
  once (terminate, then kill) and the caller gets every rank's partial report;
* **nothing left behind**: :meth:`RankGroup.close` (also at interpreter exit) ends every rank; a rank also exits
  when the parent's connection closes, and, on Linux, receives ``SIGKILL`` when its parent dies (``PR_SET_PDEATHSIG``).
  Nor on disk, even when the parent is killed or ends with ``os._exit`` (a forked, isolated check): the socket has
  an abstract name on Linux (elsewhere, a temporary directory removed once the ranks have connected), and each
  rank's stderr goes to an unnamed temporary file.

Upstream SGLang runs the same collectives over its TP group's gloo sub-groups (upstream_0523_vllm_fuzz.md §2.4).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import importlib
import multiprocessing.connection
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any, cast

__all__ = ["CallRecord", "RankGroup", "RankGroupError", "RankReply", "acquire", "collective_device", "naming",
           "release_all"]

#: Seconds the parent allows beyond the collective timeout (process scheduling on a loaded machine).
GRACE_S = 5.0


class RankGroupError(RuntimeError):
    """The group could not be started, or a command could not be delivered (a harness error, not a verdict)."""


@dataclasses.dataclass
class CallRecord:
    """One all-reduce a rank made in a command: what it passed, and the result or the error it got."""

    name: str
    op: str  # "min" | "max" | "sum"
    values: tuple[int, ...]
    layout: tuple[str, ...] | None
    result: tuple[int, ...] | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclasses.dataclass
class RankReply:
    """One rank's answer to one command: the value returned, or the error raised; its collectives in order.

    ``status``: ``"ok"``, ``"error"`` (the method raised: ``error`` has the traceback's last line), ``"hung"`` (no
    reply within the bound), or ``"dead"`` (the process ended).
    """

    rank: int
    status: str
    value: Any = None
    error: str = ""
    calls: list[CallRecord] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------- inside a rank process

_conn: Any = None  # the rank's connection to the parent
_device = "cpu"  # where the rank's collective tensors live: "cpu" on gloo, "cuda:<rank>" on NCCL
#: the names (and layouts, and projections) the worker gives the all-reduces it makes, innermost last
_naming: list[tuple[str, tuple[str, ...] | None, Callable[[tuple[int, ...]], tuple[int, ...]] | None]] = []
_real_all_reduce: Callable[..., Any] | None = None


def collective_device() -> str:
    """The device a rank's collective tensors must be on (``cuda:<rank>`` when the group runs NCCL)."""
    return _device


@contextlib.contextmanager
def naming(name: str, layout: Sequence[str] | None = None,
           project: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None) -> Iterator[None]:
    """Name the all-reduces a worker makes inside the block (the reference's op name and slot names; a name starting
    with ``_`` is internal: reported, never compared). ``project`` maps the values as passed (and the result) to
    what is reported: an adapter of a real engine reports its tensors in the reference's layout."""
    _naming.append((name, None if layout is None else tuple(layout), project))
    try:
        yield
    finally:
        _naming.pop()


def _op_name(op: Any) -> str:
    import torch.distributed as dist

    for name in ("MIN", "MAX", "SUM"):
        if op == getattr(dist.ReduceOp, name):
            return name.lower()
    return str(op)


def _observed_all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    """``torch.distributed.all_reduce``, reported to the parent before and after it runs."""
    import torch.distributed as dist

    real = _real_all_reduce
    if real is None:  # pragma: no cover - installed together
        raise RuntimeError("the observed all_reduce is not installed")
    op = dist.ReduceOp.SUM if op is None else op
    if threading.current_thread() is not threading.main_thread():  # a real engine's own background thread (SGLang's
        return real(tensor, op=op, group=group, async_op=async_op)  # consensus checker): not the command's exchange
    name, layout, project = _naming[-1] if _naming else ("all_reduce", None, None)
    shown = project or (lambda v: v)
    values = shown(tuple(int(v) for v in tensor.reshape(-1).tolist()))
    if layout is not None and len(layout) != len(values):
        layout = None
    _conn.send(("calling", CallRecord(name, _op_name(op), values, layout)))
    start = time.monotonic()
    try:
        out = real(tensor, op=op, group=group, async_op=async_op)
        if async_op:
            out.wait()
    except BaseException as err:
        _conn.send(("called", None, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}",
                    time.monotonic() - start))
        raise
    _conn.send(("called", shown(tuple(int(v) for v in tensor.reshape(-1).tolist())), None, time.monotonic() - start))
    return out


def _die_with_parent() -> None:
    """On Linux, ask the kernel to SIGKILL this process when its parent dies (a rank stuck in C++ included)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _rank_main(rank: int, world_size: int, address: str, timeout_s: float) -> None:
    """The body of one rank process: join the group, then serve commands until told to stop or the pipe closes."""
    global _conn, _real_all_reduce, _device
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if address.startswith("@"):  # an abstract socket's name (RankGroup): argv cannot carry its leading NUL
        address = "\0" + address[1:]
    conn = multiprocessing.connection.Client(address, family="AF_UNIX",
                                             authkey=bytes.fromhex(os.environ.pop("KVPROOF_RANK_KEY")))
    conn.send(rank)
    _conn = conn
    try:
        import torch
        import torch.distributed as dist

        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
        backend = "nccl" if cuda else "gloo"
        if not cuda and os.path.isdir("/sys/class/net/lo"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if cuda:
            torch.cuda.set_device(rank)
            _device = f"cuda:{rank}"
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            conn.send(("port", store.port))
        else:
            port = conn.recv()
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        _real_all_reduce = dist.all_reduce
        dist.all_reduce = _observed_all_reduce  # observed in this process only
        conn.send(("ready", backend))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises RankGroupError
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    worker: Any = None
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            break
        if method == "stop":
            break
        try:
            if method == "__init__":
                spec, kwargs = args
                module, _, cls = spec.partition(":")
                worker = getattr(importlib.import_module(module), cls)(rank=rank, world_size=world_size, **kwargs)
                value = None
            else:
                value = getattr(worker, method)(*args)
            conn.send(("done", value))
        except BaseException as err:  # noqa: BLE001 - every failure is the parent's to judge
            last = traceback.format_exception_only(type(err), err)[-1].strip()
            conn.send(("error", last[:500]))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


# ---------------------------------------------------------------- in the parent


class RankGroup:
    """``world_size`` rank processes in one process group (module docstring)."""

    def __init__(self, world_size: int, *, collective_timeout: float = 5.0, start_timeout: float = 120.0) -> None:
        if not 1 <= world_size <= 8:
            raise RankGroupError(f"world_size {world_size} outside 1..8")
        self.world_size = world_size
        self.collective_timeout = collective_timeout
        self.broken = ""  # why the group can no longer be used ("" while it can)
        self.backend = ""
        self.owner = os.getpid()  # a forked child must not use (or stop) its parent's group
        self._conns: list[Any] = [None] * world_size
        self._procs: list[subprocess.Popen[bytes]] = []
        self._stderrs: list[Any] = []  # each rank's stderr: an unnamed file (nothing on disk to leave behind)
        self._dir = ""  # where the socket lives until the ranks connect, off Linux (on Linux: an abstract name)
        started = time.monotonic()
        _GROUPS.add(self)
        try:
            key = secrets.token_bytes(16)
            if sys.platform.startswith("linux"):  # abstract socket: a name with no file, gone with the listener
                name = f"kvproof-ranks-{os.getpid()}-{secrets.token_hex(8)}"
                address, passed = "\0" + name, "@" + name  # argv cannot carry the NUL: the rank restores it
            else:
                self._dir = tempfile.mkdtemp(prefix="kvproof-ranks-")
                address = passed = os.path.join(self._dir, "sock")
            listener = multiprocessing.connection.Listener(address, family="AF_UNIX", authkey=key)
            env = dict(os.environ, KVPROOF_RANK_KEY=key.hex())
            for rank in range(world_size):  # python -m: no re-import of the caller's __main__ (unlike spawn)
                err = tempfile.TemporaryFile(prefix="kvproof-rank-")  # noqa: SIM115 - open until close()
                self._stderrs.append(err)  # a dead rank's last words (not on the console)
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvproof.gpu_runtime._ranks", str(rank), str(world_size), passed,
                     repr(collective_timeout)], env=env, stdin=subprocess.DEVNULL, stderr=err))
            self._accept(listener, started + start_timeout)
            self._remove_dir()  # every rank is connected: the socket's name is no longer needed
            port = self._expect(0, "port", started + start_timeout)
            for conn in self._conns[1:]:
                conn.send(port)
            for rank in range(world_size):
                self.backend = self._expect(rank, "ready", started + start_timeout)
        except BaseException:
            self.close()
            raise

    def _remove_dir(self) -> None:
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def last_words(self, rank: int) -> str:
        """The last line a rank wrote to stderr that is not a warning (what a dead rank said), or ``""``."""
        try:
            fd = self._stderrs[rank].fileno()
            text = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")  # pread: the rank's offset stays
        except (IndexError, OSError, ValueError):
            return ""
        said, warning = [], False
        for line in text.splitlines():
            if "Warning" in line or "warn" in line:  # a warning (torch's about numpy, ...)
                warning = True
            elif warning and line[:1].isspace():  # and the source line Python prints under it
                pass
            elif line.strip():
                said.append(line.strip())
                warning = False
        return said[-1][:300] if said else ""

    def _accept(self, listener: Any, deadline: float) -> None:
        """Each rank connects and names itself; a rank that dies or never connects fails the start (bounded)."""
        accepted: list[Any] = []
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                for _ in range(self.world_size):
                    accepted.append(listener.accept())
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        thread = threading.Thread(target=loop, name="kvproof-rank-accept", daemon=True)
        thread.start()
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(0.1)
            dead = [r for r, p in enumerate(self._procs) if p.poll() is not None]
            if dead:
                break
        listener.close()  # ends a pending accept
        thread.join(1.0)
        if len(accepted) != self.world_size:
            exited = {r: p.returncode for r, p in enumerate(self._procs) if p.poll() is not None}
            for conn in accepted:
                conn.close()
            raise RankGroupError(f"{len(accepted)} of {self.world_size} ranks connected "
                                 f"(exited: {exited or 'none'}; {errors[0] if errors else 'start timeout'})")
        for conn in accepted:
            rank = conn.recv()
            self._conns[rank] = conn

    def _expect(self, rank: int, kind: str, deadline: float) -> Any:
        conn = self._conns[rank]
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise RankGroupError(f"rank {rank} did not start within the start timeout")
        try:
            message = conn.recv()
        except (EOFError, OSError) as err:
            raise RankGroupError(f"rank {rank} died while starting (exit code {self._procs[rank].poll()})") from err
        if message[0] != kind:
            raise RankGroupError(f"rank {rank} failed to start: {message[1] if len(message) > 1 else message}")
        return message[1]

    def __repr__(self) -> str:
        return f"RankGroup(world_size={self.world_size}, backend={self.backend!r}, broken={self.broken!r})"

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self._procs)

    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def command(self, method: str, args: Sequence[tuple[Any, ...]] | None = None, *,
                collectives: int = 2, seconds: float = 0.0) -> list[RankReply]:
        """Run ``worker.method(*args[rank])`` on every rank at once; each rank's reply, within a bounded time.

        ``collectives``: how many collectives the command may make (the bound is that many collective timeouts
        plus :data:`GRACE_S`, plus ``seconds`` for work that is not a collective: a real engine's imports). A rank
        that errs, hangs or dies breaks the group: it is torn down before this returns, and ``broken`` says why.
        """
        if self.broken:
            raise RankGroupError(f"the rank group is broken ({self.broken}); build a new one")
        per_rank = list(args) if args is not None else [()] * self.world_size
        if len(per_rank) != self.world_size:
            raise RankGroupError(f"{len(per_rank)} argument tuples for {self.world_size} ranks")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((method, per_rank[rank]))
            except (OSError, BrokenPipeError) as err:
                self._break(f"rank {rank} is gone ({err})")
                raise RankGroupError(self.broken) from err
        bound = max(1, collectives) * self.collective_timeout + GRACE_S + seconds
        deadline = time.monotonic() + bound
        replies = [RankReply(rank, "pending") for rank in range(self.world_size)]
        pending: dict[Connection, int] = {conn: rank for rank, conn in enumerate(self._conns)}
        while pending:
            ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for ready_conn in ready:
                conn = cast(Connection, ready_conn)
                rank = pending[conn]
                reply = replies[rank]
                try:
                    message: Any = conn.recv()
                except (EOFError, OSError):
                    with contextlib.suppress(subprocess.TimeoutExpired):  # its exit code and last words
                        self._procs[rank].wait(2.0)
                    said = self.last_words(rank)
                    reply.status, reply.error = "dead", (f"rank {rank} died (exit code {self._procs[rank].poll()})"
                                                         + (f": {said}" if said else ""))
                    del pending[conn]
                    continue
                kind = message[0]
                if kind == "calling":
                    reply.calls.append(message[1])
                elif kind == "called":
                    call = reply.calls[-1]
                    call.result, call.error, call.seconds = message[1], message[2], message[3]
                elif kind == "done":
                    reply.status, reply.value = "ok", message[1]
                    del pending[conn]
                elif kind == "error":
                    reply.status, reply.error = "error", message[1]
                    del pending[conn]
        for rank in pending.values():
            replies[rank].status = "hung"
            replies[rank].error = f"rank {rank}: no reply within {bound:g} s"
        bad = [r for r in replies if r.status != "ok"]
        if bad:
            self._break("; ".join(f"rank {r.rank} {r.status}: {r.error}" for r in bad))
        return replies

    def _break(self, why: str) -> None:
        self.broken = why
        self.close()

    def close(self) -> None:
        """Stop every rank: ask, then terminate, then kill; wait for each (bounded). Idempotent. In a forked child
        it only forgets the parent's group."""
        if self.owner != os.getpid():
            _GROUPS.discard(self)
            return
        for conn in self._conns:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.send(("stop", ()))
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.01, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(1.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5.0)
        for conn in self._conns:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        for err in self._stderrs:
            err.close()
        self._procs, self._conns, self._stderrs = [], [], []
        self._remove_dir()
        if not self.broken:
            self.broken = "closed"
        _GROUPS.discard(self)


# ---------------------------------------------------------------- one warm group per world size

_GROUPS: set[RankGroup] = set()
_POOL: dict[tuple[int, float, str], RankGroup] = {}
_POOL_LOCK = threading.Lock()


def acquire(world_size: int, collective_timeout: float, purpose: str = "") -> RankGroup:
    """A started group of ``world_size`` ranks, reused across calls while it is healthy (starting one costs
    seconds: every rank imports torch and joins the group); a broken or closed one is replaced. Workers of another
    ``purpose`` (an adapter that imports a real engine into its ranks) get groups of their own."""
    key = (world_size, collective_timeout, purpose)
    with _POOL_LOCK:
        group = _POOL.get(key)
        if group is not None and group.owner != os.getpid():  # inherited through fork: the parent's to use
            _GROUPS.discard(group)
            group = None
        if group is None or group.broken or not group.alive():
            if group is not None:
                group.close()
            group = RankGroup(world_size, collective_timeout=collective_timeout)
            _POOL[key] = group
        return group


def release_all() -> None:
    """Close every group of this process (also run at interpreter exit)."""
    with _POOL_LOCK:
        _POOL.clear()
    for group in list(_GROUPS):
        group.close()


atexit.register(release_all)


if __name__ == "__main__":  # a rank process: run the imported module's copy, whose globals workers share
    from kvproof.gpu_runtime import _ranks

    _ranks._rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
