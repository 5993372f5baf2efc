"""Isolation: one config's run in a child process the harness supervises (issue #11, deliver 2).

An implementation runs in kvproof's own process unless told otherwise, and there it
could pick the verdict: ``sys.exit(0)`` inside an operation would end the run with exit
code 0, ``os._exit(7)`` or a segfault would take the report with it, a loop that
swallows ``BaseException`` outlives the per-call alarm, a blocking constructor has no
deadline at all, a memory hog takes the machine. :func:`run_isolated` runs the work of
one config (the whole Hypothesis run, harness and implementation together, so every
in-process semantic is kept: the ``loc_cache`` suite hands the implementation tensors at
addresses it chose and reads static buffers the implementation keeps) in a forked child
and returns its result, or a :class:`Crash` when the child did not deliver one:

* the child reports each implementation call it enters and leaves in a few bytes of
  shared memory (no system call): the parent kills a call that has not returned within
  the per-call timeout (plus :data:`GRACE`) -- the factory included, and whatever the call
  does with the alarm the child raises first;
* before each call it appends what changed since the last one (trace lines, recorded
  vector steps) to an event log in shared memory (:data:`LOG_BYTES`; no system call, and
  the parent does no work for it while the child lives): the parent reads it when the child
  dies, hangs or exceeds its memory, and so holds the operations so far and a replayable
  vector of the current example. The log restarts with each example; an example that
  outgrows it has its older records sent over the pipe first (nothing is dropped);
* the parent reads the child's resident memory every :data:`POLL` seconds and kills it
  when it grew by more than the limit (``memory_limit_mb``; 0: no limit);
* the child's stdout and stderr go to a file (nothing it prints interleaves with the
  parent's output); the last lines are quoted in a crash verdict (a segfault's Python
  traceback, from :mod:`faulthandler`, among them);
* the child ends with ``os._exit`` after sending its result (no ``atexit`` handler, no
  pytest teardown runs there); the parent always reaps it, also on Ctrl-C.

One child per config, reused across all examples of that config: the start costs one
``fork`` (``kvproof bench`` measures it and the per-step cost of the reporting). The child
runs torch single-threaded (OpenMP's thread team does not survive ``fork``). CUDA does not
survive it either: once this process has initialised CUDA, :func:`fork_problem` says so
and runs fall back to in-process (with a warning); this module sets
``PYTORCH_NVML_BASED_CUDA_CHECK`` so that asking whether a GPU is present does not
initialise CUDA.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import mmap
import os
import pickle
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from typing import Any, Generic, TypeVar

from kvproof.conformance.errors import HarnessBug
from kvproof.conformance.lockstep import Lockstep, Trace, set_monitor

__all__ = ["DEFAULT_MEMORY_LIMIT_MB", "GRACE", "ISOLATION_MODES", "POLL", "Crash", "fork_problem", "notify",
           "run_isolated"]

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # torch.cuda.is_available() without initialising CUDA

#: ``process``: each config's run in a supervised child (the default); ``in-process``: in kvproof's process.
ISOLATION_MODES = ("process", "in-process")
#: MiB the implementation's process may grow by over its size at start (0: no limit).
DEFAULT_MEMORY_LIMIT_MB = 8192
#: Seconds between the parent's looks at the child (call deadline, memory, death).
POLL = 0.05
#: Seconds the parent waits past the per-call timeout before it kills (the child's own alarm goes first).
GRACE = 1.0

T = TypeVar("T")
#: the child's pipe to its parent (``None`` outside an isolated child): :func:`notify` writes to it
_notes: Connection | None = None
_CALL = struct.Struct("<dH")  # entered at (monotonic seconds, 0: no call in progress), length of what
_WHAT = 200  # bytes of the call's name kept
#: Bytes of the child's event log (shared memory; pages are touched only as an example's records fill them).
LOG_BYTES = 4 << 20
_LOG_HEAD = struct.Struct("<QQ")  # end of the last complete record, examples begun
_RECORD = struct.Struct("<I")  # a record's length, then the pickled (new example?, trace journal, vector steps)


@dataclass
class Crash:
    """The child ended without a result: why, in which call, and what the current example had done."""

    reason: str  # e.g. "exited with code 7", "was killed by signal SIGSEGV", "hung", "memory"
    message: str  # the verdict's one line: what happened, in which call
    what: str  # the call in progress ("" between calls)
    trace: Trace
    vector: list[dict[str, Any]]
    examples: int
    output: str  # the last lines the child printed

    @property
    def step(self) -> int:
        return len(self.trace)


@dataclass
class _Outcome(Generic[T]):
    result: T | None = None
    done: bool = False
    error: BaseException | None = None
    crash: Crash | None = None
    trace: Trace = field(default_factory=Trace)
    vector: list[dict[str, Any]] = field(default_factory=list)
    examples: int = 0
    on_note: Callable[[tuple[Any, ...]], None] | None = None


class _Reporter:
    """The child's side (a :class:`~kvproof.conformance.lockstep.CallMonitor`): calls to shared memory, changes
    of the trace and the vector to the event log, before each call."""

    def __init__(self, conn: Connection, shared: mmap.mmap, log: mmap.mmap) -> None:
        self.conn, self.shared, self.log = conn, shared, log
        self.depth, self.new_example, self.sent_steps, self.sent_draws = 0, False, 0, -1
        self.end, self.examples = _LOG_HEAD.size, 0  # where the next record goes; examples begun

    def example(self, machine: Lockstep[Any, Any]) -> None:
        self.new_example, self.sent_steps, self.sent_draws = True, 0, -1

    def enter(self, what: str, machine: Lockstep[Any, Any] | None) -> None:
        self.depth += 1
        if self.depth > 1:  # a nested call runs inside the outer one's deadline
            return
        if machine is not None:
            self._flush(machine)
        name = what.encode("utf-8", "replace")[:_WHAT]
        self.shared[_CALL.size:_CALL.size + len(name)] = name
        _CALL.pack_into(self.shared, 0, time.monotonic(), len(name))

    def leave(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            _CALL.pack_into(self.shared, 0, 0.0, 0)

    def _flush(self, machine: Lockstep[Any, Any]) -> None:
        journal = machine.trace.journal or []
        vector = machine.vector
        draws = len(vector[-1]["draws"]) if vector else -1
        steps: tuple[int, list[dict[str, Any]]] | None = None
        if len(vector) != self.sent_steps or draws != self.sent_draws:
            start = max(min(self.sent_steps, len(vector)) - 1, 0)  # the last step sent may have drawn since
            steps = (start, vector[start:])
            self.sent_steps, self.sent_draws = len(vector), draws
        if journal or steps is not None or self.new_example:
            self._append(pickle.dumps((self.new_example, list(journal), steps), pickle.HIGHEST_PROTOCOL))
            journal.clear()
            self.new_example = False

    def _append(self, record: bytes) -> None:
        """One record into the log, committed (the head's end moved past it) only once it is whole: a child killed
        while writing leaves the log as it was. A new example starts the log over; a record that does not fit
        sends the log's records so far over the pipe first (the parent applies them before the log)."""
        log, size = self.log, _RECORD.size + len(record)
        if self.new_example:
            self.end = _LOG_HEAD.size
            self.examples += 1
        if self.end + size > len(log):
            if self.end > _LOG_HEAD.size:
                self._send(("log", bytes(log[_LOG_HEAD.size:self.end])))
                self.end = _LOG_HEAD.size
            if self.end + size > len(log):  # larger than the whole log: it goes over the pipe
                self._send(("log", _RECORD.pack(len(record)) + record))
                _LOG_HEAD.pack_into(log, 0, self.end, self.examples)
                return
        _RECORD.pack_into(log, self.end, len(record))
        log[self.end + _RECORD.size:self.end + size] = record
        self.end += size
        _LOG_HEAD.pack_into(log, 0, self.end, self.examples)

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self.conn.send(message)
        except OSError:  # the parent is gone: so is the point of going on
            os._exit(1)


def notify(*message: Any) -> None:
    """Hand ``message`` to the parent's ``on_note`` as it happens (progress, a first verdict).

    In an isolated child only; elsewhere (in-process runs) it does nothing. The message must pickle.
    """
    if _notes is None:
        return
    try:
        _notes.send(("note", message))
    except OSError:  # the parent is gone: so is the point of going on
        os._exit(1)


def fork_problem() -> str | None:
    """Why this process cannot fork a working child now (``None``: it can)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in this process and does not survive fork()"
    return None


def _die_with(parent: int) -> None:
    """End this process when ``parent`` ends, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``; elsewhere a broken pipe
    ends it at its next call)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(1)


def _child(work: Callable[[], Any], conn: Connection, shared: mmap.mmap, log: mmap.mmap, output: int,
           parent: int) -> None:
    """Run ``work`` and send its result; never returns (``os._exit``)."""
    global _notes
    _notes = conn
    try:
        _die_with(parent)
        os.dup2(output, 1)
        os.dup2(output, 2)
        # fresh stream objects: another thread of the parent may have held the old ones' locks at fork()
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - process-long, like sys.stdout
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it kills this process
        torch = sys.modules.get("torch")
        if torch is not None:  # OpenMP's thread team does not survive fork(): a parallel region would hang
            torch.set_num_threads(1)
        faulthandler.enable(file=sys.stderr)
        set_monitor(_Reporter(conn, shared, log))
        result = work()
        conn.send(("done", result))
    except BaseException as err:  # noqa: BLE001 - handed to the parent, which decides what it means
        try:
            conn.send(("error", err))
        except BaseException:  # noqa: BLE001 - an exception that does not pickle
            with contextlib.suppress(BaseException):
                conn.send(("error", HarnessBug(f"in the implementation's process: {traceback.format_exc()}")))
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)


def _rss(pid: int) -> int:
    """Resident anonymous bytes of process ``pid`` (``RssAnon``: what it allocated, not the library pages it
    touches again after fork; 0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return 0
    return 0


def _tail(output: Any, lines: int = 12) -> str:
    try:
        output.seek(0, os.SEEK_END)
        size = output.tell()
        output.seek(max(0, size - 8192))
        text = output.read().decode("utf-8", "replace")
    except OSError:
        return ""
    all_lines = text.rstrip().splitlines()
    fatal = [i for i, line in enumerate(all_lines) if line.startswith("Fatal Python error")]
    if fatal:  # faulthandler's report: the crash, then the innermost frames first
        return "\n".join(all_lines[fatal[-1]:fatal[-1] + lines])
    return "\n".join(all_lines[-lines:])


def _death(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"was killed by signal {name}"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"


def run_isolated(work: Callable[[], T], *, op_timeout: float | None, memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
                 on_note: Callable[[tuple[Any, ...]], None] | None = None) -> T | Crash:
    """``work()``'s result computed in a supervised child process, or the :class:`Crash` that ended the child.

    What the child hands to :func:`notify` reaches ``on_note`` here, in this process, as it happens.

    An exception ``work`` raises is raised here (a ``HarnessBug`` or ``UsageError`` stays one); a
    ``BaseException`` that is not an ``Exception`` (``SystemExit`` outside any watched call) is a crash.
    """
    shared = mmap.mmap(-1, _CALL.size + _WHAT)
    log = mmap.mmap(-1, LOG_BYTES)
    reader, writer = Pipe(duplex=False)
    output = tempfile.TemporaryFile()  # noqa: SIM115 - the child writes it; closed below, after the crash read
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    parent = os.getpid()
    gc.freeze()  # the child's collector leaves the parent's objects alone: fewer copy-on-write page copies
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child (measured through the parent)
        reader.close()
        _child(work, writer, shared, log, output.fileno(), parent)
    gc.unfreeze()
    writer.close()
    out: _Outcome[T] = _Outcome(on_note=on_note)
    status: int | None = None
    try:
        status = _supervise(pid, reader, shared, log, out, op_timeout, memory_limit_mb)
    except BaseException:
        _kill(pid)
        raise
    finally:
        reader.close()
        if status is None:
            _kill(pid)
    try:
        if out.done:
            return out.result  # type: ignore[return-value]
        if out.crash is not None:  # killed by _supervise, which read the log then
            out.crash.output = _tail(output)
            return out.crash
        _read_log(log, out)  # the child is gone (reaped): what its current example did is all in the log
        if out.error is not None:
            if isinstance(out.error, Exception):
                raise out.error
            return _crash(out, "escaped", f"raised {out.error!r} outside any implementation call: an "
                                          "implementation may not exit the process", "", output)
        what = _what(shared)
        death = _death(status if status is not None else 0)
        during = f"during {what}" if what else "between implementation calls"
        return _crash(out, "died", f"the implementation process {death} {during}", what, output)
    finally:
        output.close()
        shared.close()
        log.close()


def _what(shared: mmap.mmap) -> str:
    entered, length = _CALL.unpack_from(shared, 0)
    return bytes(shared[_CALL.size:_CALL.size + length]).decode("utf-8", "replace") if entered else ""


def _crash(out: _Outcome[Any], reason: str, message: str, what: str, output: Any) -> Crash:
    return Crash(reason, message, what, out.trace, out.vector, out.examples, _tail(output))


def _kill(pid: int) -> None:
    """SIGKILL ``pid`` and reap it (nothing is left running)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _supervise(pid: int, reader: Connection, shared: mmap.mmap, log: mmap.mmap, out: _Outcome[Any],
               op_timeout: float | None, memory_limit_mb: int) -> int:
    """Read the child's messages until it delivers or ends; kill it on a deadline or the memory limit.

    Returns the child's wait status (it is reaped).
    """
    baseline = _rss(pid)
    limit = memory_limit_mb * 1024 * 1024
    last_look = 0.0
    while True:
        if reader.poll(POLL):
            try:
                message = reader.recv()
            except (EOFError, OSError):  # the child is gone
                return os.waitpid(pid, 0)[1]
            if _apply(message, out):
                return os.waitpid(pid, 0)[1]
            if time.monotonic() - last_look < POLL:
                continue
        now = last_look = time.monotonic()
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _drain(reader, out)
            return status
        entered, _ = _CALL.unpack_from(shared, 0)
        verdict = None
        if op_timeout is not None and entered and now - entered > op_timeout + GRACE:
            verdict = ("hung", f"{_what(shared)} did not return within {op_timeout:g} s (hung; the implementation "
                               "process was killed)")
        elif limit > 0 and (grown := _rss(pid) - baseline) > limit:
            what = _what(shared)
            during = f"during {what}" if what else "between implementation calls"
            verdict = ("memory", f"the implementation process grew by {grown // (1024 * 1024)} MiB {during}, over "
                                 f"the limit of {memory_limit_mb} MiB (--memory-limit); it was killed")
        if verdict is not None:
            what = _what(shared)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            status = os.waitpid(pid, 0)[1]
            _drain(reader, out)
            _read_log(log, out)
            out.crash = Crash(verdict[0], verdict[1], what, out.trace, out.vector, out.examples, "")
            return status


def _apply(message: tuple[Any, ...], out: _Outcome[Any]) -> bool:
    """Fold one message of the child into ``out``; ``True`` when it is the last (a result or an error)."""
    kind = message[0]
    if kind == "log":
        _apply_records(message[1], 0, len(message[1]), out)
        return False
    if kind == "note":
        if out.on_note is not None:
            out.on_note(message[1])
        return False
    if kind == "done":
        out.result, out.done = message[1], True
    elif kind == "error":
        out.error = message[1]
    return True


def _apply_records(buffer: Any, start: int, end: int, out: _Outcome[Any]) -> None:
    """Fold the event records in ``buffer[start:end]`` into ``out`` (the current example's trace and vector)."""
    while start < end:
        (length,) = _RECORD.unpack_from(buffer, start)
        start += _RECORD.size
        new_example, journal, steps = pickle.loads(buffer[start:start + length])
        start += length
        if new_example:
            out.trace, out.vector = Trace(), []
        out.trace.repeat(journal)
        if steps is not None:
            out.vector[steps[0]:] = steps[1]


def _read_log(log: mmap.mmap, out: _Outcome[Any]) -> None:
    """The records of the child's event log (after those it sent over the pipe), and the examples it began; read
    once, when the child is gone."""
    end, examples = _LOG_HEAD.unpack_from(log, 0)
    if end:  # 0: the child never wrote one
        _apply_records(log, _LOG_HEAD.size, end, out)
        out.examples = examples


def _drain(reader: Connection, out: _Outcome[Any]) -> None:
    """Messages the child sent before it ended (its last events, or its result just before exiting)."""
    with contextlib.suppress(EOFError, OSError):
        while reader.poll(0):
            if _apply(reader.recv(), out):
                return
