"""Ending the rank processes a launch started, when it failed or was interrupted: one mechanism for the launching
process (now, `stop`) and for a detached watcher that outlives it (``python -m lit_efficient.rank_reaper``).
Standard library only: the watcher starts in a fraction of a second and holds no torch."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence

GRACE_S = 5.0  # how long a started rank has to end on its own before it is killed


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
    deadline = time.monotonic() + grace
    while any(alive(p) for p in running) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = [p for p in running if alive(p)]
    for pid in killed:
        _signal(pid, signal.SIGKILL)
    return killed


def watch_after_exit(pids: Sequence[int], grace: float = GRACE_S) -> None:
    """Start a detached watcher that runs `stop` on ``pids`` once this process has exited (its connections, on
    which the ranks wait, close only then)."""
    if pids:
        import subprocess

        subprocess.Popen(
            [sys.executable, "-m", "lit_efficient.rank_reaper", str(os.getpid()), str(grace), *map(str, pids)],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )  # fmt: skip


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


if __name__ == "__main__":
    parent, wait, *ranks = sys.argv[1:]
    for pid in stop([int(p) for p in ranks], float(wait), after=int(parent)):
        print(f"lit-efficient: rank process {pid} had not ended {float(wait):.0f} s after the failed launching "
              "process; killed it", file=sys.stderr, flush=True)  # fmt: skip
