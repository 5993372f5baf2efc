"""``kvproof prove``: discharge every Z3 obligation and print one row per obligation.

:func:`prove` runs the obligations one after another in kvproof's own process (``jobs=1``)
or on ``jobs`` worker processes (a :mod:`multiprocessing` pool, "fork" where the platform
has it, else "spawn"). Z3 objects do not pickle, so a worker is sent an obligation's
component and name, looks the obligation up in :mod:`kvproof.spec` itself and sends back
the verdict's plain fields; the parent rebuilds the same :class:`~kvproof.spec.Result`
around its own obligation and returns the results in registry order, whatever order the
workers finish in. Each obligation still gets a fresh Z3 context and the same timeout, so
the verdicts are those of the serial run. A worker that raises, or whose process dies
(a segfault, the OOM killer), is a :class:`~kvproof.conformance.errors.HarnessError`
naming the obligation, never a hang; the pool is terminated however the run ends (Ctrl-C
included), so no worker outlives it.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import Any, cast

from rich.console import Console
from rich.table import Table

from kvproof import spec
from kvproof.conformance.errors import HarnessError, UsageError
from kvproof.reference.registry import Component, parse_components
from kvproof.spec import Obligation, Result
from kvproof.spec._solver import Status

__all__ = ["effective_workers", "print_failures", "print_results", "prove", "prove_table", "select", "wall_line"]

#: how often the parent looks at its workers while it waits for a verdict (seconds)
_POLL_SECONDS = 0.2
#: a worker that died may have sent its last verdict just before: wait this long for it before blaming it
_DEATH_GRACE_SECONDS = 1.0
#: no worker holds an obligation yet some are unfinished: after this long the pool has lost them
_LOST_AFTER_SECONDS = 10.0


def effective_workers(jobs: int, count: int) -> int:
    """How many worker processes ``jobs`` gives for ``count`` obligations (never more than there are); 1 means
    in kvproof's own process."""
    return max(1, min(jobs, count))


def select(components: Iterable[Component | str] = (), name_filter: str | None = None) -> list[Obligation]:
    """The obligations :func:`prove` runs, in registry order; :class:`UsageError` when there are none (naming the
    filter and the components)."""
    chosen = parse_components(components) or tuple(Component)
    selected = [ob for c in chosen for ob in spec.obligations(c.value, name_filter)]
    if not selected:
        where = ", ".join(c.value for c in chosen)
        raise UsageError(f"-k {name_filter!r} matches no obligation of {where}" if name_filter
                         else f"no obligation is registered for {where}")
    return selected


def prove(components: Iterable[Component | str] = (), name_filter: str | None = None,
          timeout_ms: int = 20_000, progress: Callable[[str], None] | None = None,
          done: Callable[[list[Result]], None] | None = None, jobs: int = 1) -> list[Result]:
    """Every obligation of the chosen components (default: every component of the registry), in registry order.

    ``jobs``: worker processes (at most one per obligation); 1 runs them one after another in this process.
    ``progress`` hears "obligation i/n: name" before each one (as a worker starts it), ``done`` the results
    so far (in registry order) after each (incremental reports). :class:`UsageError` when the selection
    matches no obligation (naming the filter and the components) or ``jobs`` < 1; :class:`HarnessError`
    naming the obligation when a worker raises or dies.
    """
    if jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {jobs}")
    selected = select(components, name_filter)
    workers = effective_workers(jobs, len(selected))
    if workers > 1:
        return _prove_parallel(selected, timeout_ms, workers, progress, done)
    results = []
    for i, ob in enumerate(selected, 1):
        if progress is not None:
            progress(f"prove: obligation {i}/{len(selected)}: {ob.name}")
        results.append(spec.run(ob, timeout_ms=timeout_ms))
        if done is not None:
            done(results)
    return results


# ---------------------------------------------------------------- worker processes

#: a worker's answer: (index, status, seconds, detail), status None when proving raised (detail: the traceback)
_Outcome = tuple[int, str | None, float, str]
#: the worker's end of the queue on which it says (its pid, the index) before it starts an obligation
_started: Any = None


def _init_worker(started: Any) -> None:
    global _started
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it terminates the pool
    _started = started


@functools.cache
def _by_name(component: str) -> dict[str, Obligation]:
    return {ob.name: ob for ob in spec.obligations(component)}


def _prove_one(task: tuple[int, str, str, int]) -> _Outcome:
    index, component, name, timeout_ms = task
    _started.put((os.getpid(), index))
    try:
        result = spec.run(_by_name(component)[name], timeout_ms=timeout_ms)
    except Exception:  # noqa: BLE001 - a harness error: the parent raises it, naming the obligation
        return index, None, 0.0, traceback.format_exc()
    return index, result.status, result.seconds, result.detail


def _start_method() -> str:
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def _death(ob: Obligation, proc: BaseProcess | None) -> HarnessError:
    code = None if proc is None else proc.exitcode
    how = ("exit code unknown" if code is None else
           f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
           else f"exit code {code}")
    return HarnessError(f"prove: the worker process proving {ob.name} died ({how}); "
                        f"run `kvproof prove --jobs 1 -k {ob.name}` to see it in kvproof's own process")


def _prove_parallel(selected: list[Obligation], timeout_ms: int, workers: int,
                    progress: Callable[[str], None] | None,
                    done: Callable[[list[Result]], None] | None) -> list[Result]:
    ctx = multiprocessing.get_context(_start_method())
    started = ctx.SimpleQueue()
    count = len(selected)
    finished: dict[int, Result] = {}
    running: dict[int, tuple[int, float]] = {}  # worker pid -> (index of its obligation, when it was heard of)
    seen: dict[int, BaseProcess] = {}  # the children seen alive, by pid (a worker's exit code, once it died)
    dead_since: dict[int, float] = {}  # pid -> when its death was noticed
    begun = 0
    idle_since: float | None = None

    def hear_starts() -> None:
        nonlocal begun
        while not started.empty():
            pid, index = started.get()
            begun += 1
            if index not in finished:
                running[pid] = (index, time.monotonic())
            if progress is not None:
                progress(f"prove: obligation {begun}/{count}: {selected[index].name}")

    def check_workers() -> None:
        """A HarnessError for an obligation whose worker died holding it; also one for obligations the pool
        lost (a worker died before saying which it had taken)."""
        nonlocal idle_since
        now = time.monotonic()
        alive = look()
        for pid, (index, heard) in list(running.items()):
            if index in finished:
                del running[pid]
            elif pid not in alive and (pid in seen or now - heard >= _DEATH_GRACE_SECONDS):  # it was alive
                since = dead_since.setdefault(pid, now)
                if now - since >= _DEATH_GRACE_SECONDS:
                    raise _death(selected[index], seen.get(pid))
        if running or len(finished) == count:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= _LOST_AFTER_SECONDS:
            lost = [ob.name for i, ob in enumerate(selected) if i not in finished]
            raise HarnessError(f"prove: a worker process died before saying which obligation it had taken; "
                               f"{len(lost)} unfinished: {', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''}")

    def look() -> set[int]:
        """The pids of this process's live children; each is remembered in ``seen``."""
        alive = {p.pid: p for p in ctx.active_children() if p.pid is not None}
        seen.update(alive)
        return set(alive)

    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(started,))
    try:
        look()  # the first workers (a replacement is seen at the next look, or its exit code is unknown)
        tasks = [(i, ob.component, ob.name, timeout_ms) for i, ob in enumerate(selected)]
        outcomes = pool.imap_unordered(_prove_one, tasks, chunksize=1)
        while len(finished) < count:
            try:
                index, status, seconds, detail = outcomes.next(timeout=_POLL_SECONDS)
            except multiprocessing.TimeoutError:
                hear_starts()
                check_workers()
                continue
            hear_starts()
            look()
            ob = selected[index]
            if status is None:
                raise HarnessError(f"prove: proving {ob.name} raised in its worker process:\n{detail.rstrip()}")
            finished[index] = Result(ob, cast(Status, status), seconds, detail)
            for pid, (held, _) in list(running.items()):
                if held == index:
                    del running[pid]
            if done is not None:
                done([finished[i] for i in sorted(finished)])
    finally:
        pool.terminate()  # Ctrl-C, a harness error or done: no worker outlives the run
        pool.join()
        started.close()
    return [finished[i] for i in range(count)]


def wall_line(results: list[Result], wall_seconds: float, workers: int) -> str:
    """``kvproof prove: N obligations in W s wall on K workers (S s of solver time, S/W x)``."""
    solver = sum(r.seconds for r in results)
    ratio = solver / wall_seconds if wall_seconds > 0 else 0.0
    return (f"kvproof prove: {len(results)} obligation{'' if len(results) == 1 else 's'} in {wall_seconds:.2f} s "
            f"wall on {workers} worker{'' if workers == 1 else 's'} ({solver:.2f} s of solver time, {ratio:.2f}x)")


def prove_table(results: list[Result]) -> Table:
    table = Table(title="kvproof prove", show_lines=False)
    for col in ("obligation", "component", "expect", "result", "seconds"):
        table.add_column(col, justify="right" if col == "seconds" else "left", no_wrap=True,
                         min_width=max((len(r.obligation.name) for r in results), default=0)
                         if col == "obligation" else None)  # full names (print_results picks a narrow layout)
    for r in results:
        ob = r.obligation
        mark = "[green]ok[/]" if r.ok else "[red]FAIL[/]"
        table.add_row(ob.name, ob.component, ob.expect, f"{r.status} {mark}", f"{r.seconds:.3f}")
    return table


def print_results(console: Console, results: list[Result]) -> None:
    """The table when the longest obligation name fits on one row at the console's width; else one line per
    obligation with the name last and never wrapped or cut (``grep``-able whatever the width)."""
    longest = max((len(r.obligation.name) for r in results), default=0)
    if console.width >= longest + 64:
        console.print(prove_table(results))
        return
    console.print("kvproof prove  (verdict, result, seconds, obligation)", style="italic", highlight=False)
    for r in results:
        ob = r.obligation
        mark = "[green]ok  [/]" if r.ok else "[red]FAIL[/]"
        result = r.status if r.ok else f"{r.status} (expected {ob.expect})"
        console.print(f"{mark} {result:<15} {r.seconds:7.3f}  {ob.name}", soft_wrap=True, highlight=False)


def print_failures(console: Console, results: list[Result], *, show_counterexamples: bool) -> None:
    for r in results:
        if not r.ok or (show_counterexamples and r.status == "counterexample"):
            head = "FAILED" if not r.ok else "counterexample (expected)"
            console.print(f"\n[bold]{r.obligation.name}[/] {head}: {r.obligation.statement}")
            if r.detail:
                console.print(r.detail, markup=False, highlight=False, soft_wrap=True)
