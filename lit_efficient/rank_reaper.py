"""Ending the rank processes a launch started, when it failed or was interrupted: one mechanism for the launching
process (now, `stop`), for a detached watcher that outlives it (``python -m lit_efficient.rank_reaper``), and for the
thread that watches the ranks while it trains (`RankObserver`). Standard library only: the watcher starts in a
fraction of a second and holds no torch."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from subprocess import Popen

GRACE_S = 5.0  # how long a started rank has to end on its own before it is killed
LINGER_S = 10.0  # how long a failed launching process waits at exit for its ranks to read its failure and end
_KILL = getattr(signal, "SIGKILL", signal.SIGTERM)  # Windows has no SIGKILL (Lightning's observer does the same)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, and not a zombie (exited, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def stop(pids: Sequence[int], grace: float = GRACE_S, first: int | None = None, after: int | None = None) -> list[int]:
    """Once process ``after`` (if given) has exited, signal ``first`` (if given: SIGINT, a graceful stop) to each of
    ``pids`` still running, give them ``grace`` seconds to end on their own, then kill the rest; returns those
    killed. A rank that saw the failure names its cause and ends; one hung in user code does not."""
    while after is not None and alive(after):
        time.sleep(0.1)
    running = [p for p in pids if alive(p)]
    if first is not None:
        for pid in running:
            _signal(pid, first)
    _await_exits(running, grace)
    killed = [p for p in running if alive(p)]
    for pid in killed:
        _signal(pid, _KILL)
    return killed


def _await_exits(pids: Sequence[int], seconds: float) -> None:
    """Return once none of ``pids`` runs, or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


_WATCHED: set[int] = set()  # rank pids this process has a watcher for


def watch_after_exit(procs: Sequence[Popen], release: Callable[[], object], grace: float = GRACE_S) -> None:
    """Start a detached watcher that runs `stop` on the rank processes ``procs`` still running once this process
    has exited (its connections, on which the ranks wait, close only then), and keep this process, when it begins
    its exit, up to `LINGER_S` seconds (read at the call) while they end: it hosts the rendezvous store,
    where it published its failure. A rank busy with a long step when this process raised reached its next transfer
    after this process had gone, found the store gone with it, and said "died (killed? out of memory?)" instead of
    what was raised. ``release``, called first, lets go of what the ranks may wait on here and returns what must
    stay alive meanwhile (the store); when it returns None there is nothing to read, and no wait. A rank already
    watched (a failed Trainer used again) is not watched twice."""
    running = [p for p in procs if p.poll() is None and p.pid not in _WATCHED]
    if running:
        import atexit
        import subprocess

        _WATCHED.update(p.pid for p in running)
        pids = [str(p.pid) for p in running]
        subprocess.Popen(
            [sys.executable, "-m", "lit_efficient.rank_reaper", str(os.getpid()), str(grace), *pids],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        atexit.register(_linger, running, LINGER_S, release)


def _linger(procs: Sequence[Popen], linger: float, release: Callable[[], object]) -> None:
    kept = release()  # alive until the ranks have ended (or ``linger``)
    if kept is None:
        return
    # An exit's courtesy to the ranks: a Ctrl-C here ends the wait, not with a traceback from an exit hook.
    with contextlib.suppress(KeyboardInterrupt):
        _await_exits([p.pid for p in procs], linger)
    del kept


class RankObserver(threading.Thread):
    """Watches, from the launching process (rank 0 of a ``start_method="popen"`` launch), the rank processes it
    started, in place of Lightning's observer. That one SIGKILLs this process within 5 s after any rank exits
    non-zero: unless rank 0 had already raised by then, the user's ``fit`` raised nothing, their ``finally`` blocks
    did not run and the shell said "Killed" (the cause only in the failed rank's own line).

    Here the failed rank's peers are killed after ``grace`` seconds, as Lightning kills them (a receive from them
    then fails at once), and this process has ``patience`` seconds in all to raise the failure on its own: its
    next transfer finds the peer gone and names the cause the peer published. Its raising ends the watch
    (`stand_down_observers`, from the launcher, before Lightning's exception handling and its callbacks' hooks):
    what it does next (an ``except``, a sweep's next trial) is the user's, and is not cut short. Only a process
    still running after ``patience`` without having raised (hung, or busy alone that long) is killed, saying why."""

    def __init__(self, procs: Sequence[Popen], poll: float = 1.0, grace: float = GRACE_S, patience: float = 30.0):
        super().__init__(daemon=True, name="lit-efficient-rank-observer")  # ends with this process
        self._procs, self._poll, self._grace, self._patience = list(procs), poll, grace, patience
        self._done = threading.Event()

    def start(self) -> None:
        _OBSERVERS.append(self)
        super().start()

    def stand_down(self) -> None:
        """This process raised the failure: it handles it (a script's ``except``/``finally``, a sweep's next trial)
        and must not be killed for it. The watch ends: what it does next is the user's code."""
        self._done.set()

    def run(self) -> None:
        failed = None
        while failed is None and not self._done.wait(self._poll):
            codes = [proc.poll() for proc in self._procs]
            if all(code == 0 for code in codes):
                return  # every rank ended well: nothing left to watch
            failed = next((proc for proc, code in zip(self._procs, codes, strict=True) if code), None)
        if failed is None or self._done.wait(self._grace):
            return
        for proc in self._procs:
            proc.kill()  # nothing if it has exited (Popen polls first), on every platform
        if self._done.wait(max(self._patience - self._grace, 0.0)):
            return
        print(f"lit-efficient: rank process {failed.pid} exited with code {failed.returncode} and this process "
              f"(rank 0) had not raised {self._patience:.0f} s later (hung, or busy alone that long); killing it",
              file=sys.stderr, flush=True)  # fmt: skip
        _signal(os.getpid(), _KILL)


_OBSERVERS: list[RankObserver] = []  # of this process: a later Trainer's launch starts none, yet may fail


def stand_down_observers() -> None:
    """`RankObserver.stand_down` for every observer this process started (the launching process raised)."""
    for observer in _OBSERVERS:
        observer.stand_down()


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


if __name__ == "__main__":
    parent, wait, *ranks = sys.argv[1:]
    for pid in stop([int(p) for p in ranks], float(wait), after=int(parent)):
        print(f"lit-efficient: rank process {pid} had not ended {float(wait):.0f} s after the failed launching "
              "process; killed it", file=sys.stderr, flush=True)  # fmt: skip
