"""Fault injection: how fast every rank of a pipeline learns that a stage died, raised or hung.

    python -m benchmarks.faults

Real processes over gloo on CPU, the runtime demo's model, PACI with N=2 and a 20 s p2p timeout.
One stage is made to fail at micro-batch 6: SIGKILLed, raising inside its forward, or hanging (a
sleep longer than the timeout). Each surviving rank records when its error surfaced and what it
said; the table gives the latency from the fault to each survivor's error and whether the message
names the failed stage. Writes benchmarks/results/faults.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import time
from pathlib import Path

import torch

from lit_efficient.runtime.interpreter import PipelineRuntime
from lit_efficient.runtime.partition import partition_uniform, stage_bounds
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.topology import Topology
from lit_efficient.tools.corpus import embedded_corpus
from lit_efficient.tools.demo import batches, build_layers, lm_loss
from lit_efficient.transport.process import PointToPoint
from tests.support.multiproc import spawn

TIMEOUT = 20.0


def _run(rank: int, world: int, fault: str, victim: int, stamp: str) -> None:
    topo = Topology.for_world(world, world)
    s = topo.stage_of(rank)
    layers = build_layers(n_layer=2, dim=32, heads=2, block=16)
    lo, hi = stage_bounds(partition_uniform(len(layers), world))[s]
    mine = layers[lo:hi]
    opt = torch.optim.AdamW([p for layer in mine for p in layer.parameters()], lr=1e-3)
    stage = PipelineStage(mine, s, world, opt, lm_loss)
    comm = PointToPoint(s, topo.stage_of, torch.device("cpu"), TIMEOUT)
    runtime = PipelineRuntime(stage, "paci", 2, lambda b: b[0], comm, *topo.neighbours(rank))
    for j, batch in enumerate(batches(embedded_corpus(100_000), 16, 4, 0)):
        if j == 20:
            break
        if s == victim and j == 6:
            Path(stamp).write_text(str(time.time()))
            if fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "raise":
                raise ValueError("injected failure in forward")
            time.sleep(TIMEOUT + 15)  # hang
        runtime.feed(batch, j)
    runtime.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/faults.json")
    args = parser.parse_args()
    rows = []
    for world, victim in ((2, 0), (4, 1)):
        for fault in ("sigkill", "raise", "hang"):
            stamp = Path(f"/tmp/lit_efficient_fault_{os.getpid()}")
            results = spawn(_run, world, fault, victim, str(stamp), timeout=TIMEOUT + 60)
            at = float(stamp.read_text())
            victim_rank = world - 1 - victim
            name = f"stage {victim} (rank {victim_rank})"
            for rank, res in enumerate(results):
                if rank == victim_rank:
                    continue
                rows.append(
                    {
                        "world": world, "fault": fault, "victim": name, "rank": rank,
                        "latency_s": round(res.get("finished_at", float("nan")) - at, 2),
                        "names_victim": name in res.get("error", ""),
                        "error": res.get("error", "")[:300],
                    }
                )  # fmt: skip
                print(rows[-1]["world"], fault, rank, rows[-1]["latency_s"], rows[-1]["names_victim"], flush=True)
    meta = {"command": "python -m benchmarks.faults", "p2p_timeout": TIMEOUT, "nproc": os.cpu_count(),
            "torch": torch.__version__, "platform": platform.platform()}  # fmt: skip
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
