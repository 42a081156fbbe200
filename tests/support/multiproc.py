"""Run a function on N gloo ranks in spawned processes and bring back each rank's result or error.

Ranks never raise out of the harness: each records its return value, or its exception message and
when it happened, so tests can assert on failures (a dead peer must produce a clear error) as well
as on results. A rank still running at the deadline is killed and reported as hung.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.strategies import DDPStrategy

from lit_efficient.strategy.config import _CheckedMultiProcessingLauncher

# Ranks fork from one server process that preloaded torch and Lightning (tests/conftest.py) rather than
# each importing them afresh. A forked rank does not see environment changes made after the server
# started, so `spawn` hands each rank the parent's environment (the working directory and sys.path
# multiprocessing forwards itself); PACIStrategy's launcher does the same for start_method="forkserver".
START_METHOD = "forkserver"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, tmp: str, port: int | None, environ: dict, args: tuple
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)  # one core per rank: tests and benchmarks run one thread per stage
    start = time.monotonic()
    out: dict[str, Any]
    try:
        if port is None:
            init = f"file://{tmp}/rendezvous"
        else:
            # What torchrun would set: a Lightning Trainer inside the rank treats it as launched externally.
            os.environ.update(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1",
            )  # fmt: skip
            init = "env://"
        dist.init_process_group(
            "gloo", init_method=init, rank=rank, world_size=world_size, timeout=timedelta(seconds=300)
        )
        out = {"ok": fn(rank, world_size, *args)}
    except BaseException as err:  # noqa: BLE001 - the parent asserts on it
        out = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    out["seconds"] = time.monotonic() - start
    out["finished_at"] = time.time()
    Path(tmp, f"result-{rank}.pkl").write_bytes(pickle.dumps(out))
    # Exit without tearing down the process group: a failed rank must not wait for its peers.
    os._exit(0)


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, torchrun_env: bool = False
) -> list[dict[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; one result dict per rank.

    Each dict has ``ok`` (the return value) or ``error`` (with ``traceback``), and ``seconds``;
    a rank killed at the deadline has ``error="hung"``. ``torchrun_env`` sets the variables torchrun
    would (a free port on localhost), for ranks that run a Lightning Trainer on the same group.
    Benchmarks use this harness too.
    """
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, tmp, _free_port() if torchrun_env else None, dict(os.environ), args),
            nprocs=world_size,
            join=False,
            start_method=START_METHOD,
        )
        deadline = time.monotonic() + timeout
        for proc in ctx.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        results = []
        for rank, proc in enumerate(ctx.processes):
            if proc.is_alive():
                proc.kill()
                proc.join()
            path = Path(tmp, f"result-{rank}.pkl")
            results.append(pickle.loads(path.read_bytes()) if path.exists() else {"error": "hung", "seconds": timeout})
        return results


def values(results: list[dict[str, Any]]) -> list[Any]:
    """The ranks' return values, failing with every rank's traceback if any rank failed."""
    errors = [f"rank {r}: {res.get('traceback', res['error'])}" for r, res in enumerate(results) if "error" in res]
    assert not errors, "\n".join(errors)
    return [res["ok"] for res in results]


class SpawnedDDP(DDPStrategy):
    """Lightning's DDPStrategy on forkserver ranks for reference runs, with PACIStrategy's launcher
    (Lightning's own treats forkserver like fork: on CPU its ranks would share parameter memory),
    releasing the process group at the end of each rank's run: Lightning leaves it to interpreter
    finalization, where gloo's threads intermittently abort the rank ("terminate called without an
    active exception", pytorch#179291) and fail a test that had passed. PACIStrategy does the same."""

    def __init__(self) -> None:
        super().__init__(start_method=START_METHOD)

    def _configure_launcher(self) -> None:
        self._launcher = _CheckedMultiProcessingLauncher(self, start_method=START_METHOD)

    def teardown(self) -> None:
        super().teardown()
        if dist.is_initialized():
            dist.destroy_process_group()
