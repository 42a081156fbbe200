"""Run a function on N gloo ranks in spawned processes and bring back each rank's result or error.

Ranks never raise out of the harness: each records its return value, or its exception message and
when it happened, so tests can assert on failures (a dead peer must produce a clear error) as well
as on results. A rank still running at the deadline is killed and reported as hung.
"""

from __future__ import annotations

import os
import pickle
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


def _entry(rank: int, fn: Callable[..., Any], world_size: int, tmp: str, args: tuple) -> None:
    torch.set_num_threads(1)
    start = time.monotonic()
    out: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=60),
        )  # fmt: skip
        out = {"ok": fn(rank, world_size, *args)}
    except BaseException as err:  # noqa: BLE001 - the parent asserts on it
        out = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    out["seconds"] = time.monotonic() - start
    out["finished_at"] = time.time()
    Path(tmp, f"result-{rank}.pkl").write_bytes(pickle.dumps(out))
    # Exit without tearing down the process group: a failed rank must not wait for its peers.
    os._exit(0)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; one result dict per rank.

    Each dict has ``ok`` (the return value) or ``error`` (with ``traceback``), and ``seconds``;
    a rank killed at the deadline has ``error="hung"``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _entry, args=(fn, world_size, tmp, args), nprocs=world_size, join=False, start_method="spawn"
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
