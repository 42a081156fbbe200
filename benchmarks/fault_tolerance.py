"""Fault-tolerant pipeline replicas on torchft against a whole-job restart, and a chaos run.

    python -m benchmarks.fault_tolerance                 # kill: no fault, one kill healed live, whole-job restart
    python -m benchmarks.fault_tolerance --chaos 300     # a rank killed every 20-40 s at random for 300 s
    python -m benchmarks.fault_tolerance --quick         # a short kill run

Every run is real ``torchrun`` commands (``python -m torch.distributed.run``) on CPU/gloo, one thread per rank,
training a 2-stage PACI GPT (4 x 64, block 64, micro-batch 8) with DiLoCo (H = ``--sync-every``) to ``--steps``
optimizer steps:

- ``no fault``: two replica groups (one torchrun each, ``REPLICA_GROUP_ID`` 0 and 1) behind a torchft lighthouse
  (``torchft_lighthouse``, started here), ``fault_tolerance="torchft"``.
- ``healed``: the same, rank 1 of group 1 SIGKILLs itself at ``--kill-at`` (once both groups have synced
  together); its torchrun restarts the group, which heals from group 0 at group 0's next sync.
- ``whole-job restart``: today's way, one torchrun of 4 ranks (2 replicas x 2 stages, the same DiLoCo), a
  ``ModelCheckpoint`` every H steps and ``ckpt_path="last"``; the same rank killed at the same step; torchrun
  restarts all four ranks, which resume from the last checkpoint.

- ``no fault, streaming``: the first with ``streaming_sync=True`` (Streaming DiLoCo, each stage a fragment synced
  in its turn): the outer-sync bytes per step (peak and mean) and the loss against the plain sync.
- ``whole job, no fault``: that job without the kill (its checkpoints included), the reference for the last.

Reported: wall time, the steps group 0 took while group 1 was down, kill -> healed (the restarted attempt's
``on_train_start``, i.e. after its join), the local steps group 1's kill discarded and the steps it skipped by
healing at group 0's step, whether the groups end with equal weights, the train-loss curves (and the mean of the
last 20 steps), and goodput = replica-steps in the final model (2 x steps, less the steps a group skipped while
down) per second of wall time. On a shared CPU a group that is down frees its cores for the others, which then
step faster: on GPUs they would not. Writes benchmarks/results/fault_tolerance[_chaos|_quick].json and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from benchmarks.harness import PLOTS, envelope, machine, write_json

REPO = Path(__file__).resolve().parents[1]
_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lit_efficient import PACIStrategy
    from lit_efficient.data import TextDataModule
    from lit_efficient.models import GPT

    OUT, MODE, STEPS, H, KILL_AT = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    GROUP = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

    class Record(Callback):
        def __init__(self):
            self.last, self.together = -1, None

        def on_train_start(self, trainer, pl_module):
            rank = trainer.global_rank
            (OUT / f"pid-{GROUP}-{rank}").write_text(str(os.getpid()))
            if rank == 0:
                seen = {"step": trainer.global_step, "at": time.time(), "attempt": ATTEMPT}
                with open(OUT / f"starts-{GROUP}.jsonl", "a") as f:
                    f.write(json.dumps(seen) + "\\n")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step == self.last:
                return
            self.last = step
            sent = sum(a.bytes_communicated - a.setup_bytes for a in trainer.strategy.averagers)
            with open(OUT / f"bytes-{GROUP}-{trainer.global_rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "bytes": sent, "attempt": ATTEMPT}) + "\\n")
            if trainer.global_rank == 0 and outputs is not None:
                row = {"step": step, "at": time.time(), "loss": float(outputs["loss"]), "attempt": ATTEMPT}
                with open(OUT / f"steps-{GROUP}.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\\n")
            replicas = getattr(trainer.strategy, "replicas", None)
            live = replicas.participants if replicas is not None else 2
            if live == 2 and self.together is None:
                self.together = step
            mine = (GROUP == 1) if MODE == "healed" else True
            if (KILL_AT > 0 and mine and ATTEMPT == 0 and trainer.global_rank == 1 and self.together is not None
                    and step >= KILL_AT):
                (OUT / "killed.json").write_text(json.dumps({"at": time.time(), "step": step}))
                os.kill(os.getpid(), signal.SIGKILL)

    if __name__ == "__main__":
        torch.set_num_threads(1)
        L.seed_everything(0, verbose=False)
        whole = MODE == "whole-job"
        callbacks = [Record()]
        if whole:
            callbacks.append(ModelCheckpoint(dirpath=OUT / "checkpoints", every_n_train_steps=H, save_last=True))
        ft = {} if whole else {"fault_tolerance": "torchft", "replica_groups": 2}
        ft["streaming_sync"] = MODE == "streaming"
        strategy = PACIStrategy(pipeline_stages=2, local_sgd_steps=H, outer_optimizer="nesterov", p2p_timeout=60, **ft)
        trainer = L.Trainer(
            accelerator="cpu", devices=4 if whole else 2, strategy=strategy, max_steps=STEPS,
            accumulate_grad_batches=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, enable_checkpointing=whole, callbacks=callbacks,
        )
        model = GPT(n_layer=4, n_head=4, n_embd=64, block_size=64, warmup_steps=2, max_steps=STEPS)
        data = TextDataModule(block_size=64, batch_size=8, max_bytes=400_000, seed=1)
        trainer.fit(model, datamodule=data, ckpt_path="last" if whole else None)
        if trainer.global_rank == 0:
            torch.save(model.state_dict(), OUT / f"weights-{GROUP}.pt")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(root: Path, nproc: int, mode: str, args: argparse.Namespace, kill_at: int, restarts: int,
              env: dict[str, str]) -> subprocess.Popen:  # fmt: skip
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--monitor-interval=0.2",
        str(root / "train.py"), str(root), mode, str(args.steps), str(args.sync_every), str(kill_at),
    ]  # fmt: skip
    log = open(root / f"log-{env.get('REPLICA_GROUP_ID', 'job')}.txt", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RUST_LOG="warn")
    return env


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _weights_equal(root: Path) -> bool | None:
    import torch

    paths = [root / f"weights-{g}.pt" for g in (0, 1)]
    if not all(p.exists() for p in paths):
        return None
    a, b = (torch.load(p, weights_only=True) for p in paths)
    return all(torch.equal(a[k], b[k]) for k in a)


def _groups(root: Path, mode: str, args: argparse.Namespace, kill_at: int, restarts: int,
            chaos_s: float = 0.0) -> dict:  # fmt: skip
    """Two replica groups behind a fresh lighthouse; returns what happened."""
    port = _free_port()
    lighthouse = subprocess.Popen(
        ["torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
         "--heartbeat_timeout_ms", "2000", "--bind", f"[::]:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    start = time.time()
    procs = []
    for group in (0, 1):
        env = _env() | {"REPLICA_GROUP_ID": str(group), "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
        procs.append(_torchrun(root, 2, mode, args, kill_at, restarts, env))
    kills: list[dict] = []
    if chaos_s:
        stop = threading.Event()
        thread = threading.Thread(target=_chaos, args=(root, chaos_s, start, kills, stop), daemon=True)
        thread.start()
    codes = [p.wait(timeout=args.timeout) for p in procs]
    wall = time.time() - start
    if chaos_s:
        stop.set()
    lighthouse.kill()
    return {"codes": codes, "wall_s": round(wall, 1), "start": start, "kills": kills}


def _chaos(root: Path, seconds: float, start: float, kills: list[dict], stop: threading.Event) -> None:
    """Every 20-40 s until ``seconds`` have passed: SIGKILL a random rank of a group (the other one than last time,
    3 times in 4) whose peer group is stepping (a kill of the only live group would lose everything: that is a
    whole-job failure); a tick whose peer is down or healing kills nothing."""
    rng = random.Random(0)
    group = 0
    while not stop.wait(rng.uniform(20, 40)) and time.time() - start < seconds:
        group = 1 - group if rng.random() < 0.75 else group  # mostly the other group than last time: both get hit
        peer = _read_jsonl(root / f"steps-{1 - group}.jsonl")
        if not peer or time.time() - peer[-1]["at"] > 3:
            continue  # the peer is down or healing: wait for the next tick
        rank = rng.choice((0, 1))
        pid_file = root / f"pid-{group}-{rank}"
        if not pid_file.exists():
            continue
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            continue
        mine = _read_jsonl(root / f"steps-{group}.jsonl")
        kills.append({"at": time.time(), "group": group, "rank": rank, "step": mine[-1]["step"] if mine else None})
        print(f"chaos: killed group {group} rank {rank} at {time.time() - start:.0f} s", flush=True)


def _summary(root: Path, run: dict, args: argparse.Namespace, name: str, end_equal: bool = True) -> dict:
    """What happened; ``ok`` when both groups ran every step, none had to start over alone, and (``end_equal``:
    every stage syncs at the last step, not under streaming) they end with the same weights."""
    steps = {g: _read_jsonl(root / f"steps-{g}.jsonl") for g in (0, 1)}
    starts = {g: _read_jsonl(root / f"starts-{g}.jsonl") for g in (0, 1)}
    final = {g: (steps[g][-1]["step"] if steps[g] else None) for g in (0, 1)}
    replicas = 2
    row = {
        "run": name, "ok": run["codes"] == [0, 0] and all(f == args.steps for f in final.values()),
        "wall_s": run["wall_s"], "final_step": final, "weights_equal": _weights_equal(root),
        "late_loss": {g: _late_loss(steps[g]) for g in (0, 1)},
        "restarts": {g: sum(1 for s in starts[g] if s["attempt"] > 0) for g in (0, 1)},
        "loss": {g: [(s["step"], round(s["loss"], 4)) for s in steps[g]] for g in (0, 1)},
    }  # fmt: skip
    killed = root / "killed.json"
    if killed.exists():
        kill = json.loads(killed.read_text())
        back = next((s for s in starts[1] if s["attempt"] > 0), None)
        row["kill"] = kill
        if back is not None:
            row["kill_to_healed_s"] = round(back["at"] - kill["at"], 1)
            row["healed_at_step"] = back["step"]
            row["group0_steps_while_down"] = sum(1 for s in steps[0] if kill["at"] < s["at"] < back["at"])
            # Group 1's local steps since its last sync are the work the kill threw away; the steps it skipped by
            # healing at group 0's step are the replica-steps its shard never contributed.
            row["group1_local_steps_discarded"] = kill["step"] - (kill["step"] // args.sync_every) * args.sync_every
            if back["step"] < kill["step"]:  # group 0 had finished: nobody to heal from, group 1 started over alone
                row["group1_started_over"] = True
            else:
                row["group1_steps_missed"] = back["step"] - kill["step"]
    row["sync_bytes_per_step"] = _bytes_per_step(root, 0)
    end_equal = end_equal and args.steps % args.sync_every == 0  # the last step is a sync
    if end_equal and row["weights_equal"] is not True:  # a healed group's weights are the live group's
        row["ok"] = False
    if row.get("group1_started_over"):  # the live group had finished: nothing healed
        row["ok"] = False
    if run["kills"]:
        row["chaos_kills"] = run["kills"]
        missed = 0
        for kill in run["kills"]:  # each kill's group resumed at the first start after it
            back = next((s for s in starts[kill["group"]] if s["at"] > kill["at"] and s["attempt"] > 0), None)
            if back is not None and kill["step"] is not None and back["step"] >= kill["step"]:
                missed += back["step"] - kill["step"]
            elif back is not None:  # no live group to heal from: it started over alone
                row["started_over"] = row.get("started_over", 0) + 1
                row["ok"] = False
        row["replica_steps_missed"] = missed
    missed = row.get("group1_steps_missed", row.get("replica_steps_missed", 0))
    # Goodput: replica-steps that made it into the final model (each group's steps, less those a group skipped
    # while it was down) per second of wall time.
    row["goodput_steps_per_s"] = round((replicas * args.steps - missed) / run["wall_s"], 3)
    return row


def _bytes_per_step(root: Path, group: int) -> dict[str, float] | None:
    """What group ``group``'s ranks put into outer-sync all-reduces at each optimizer step (payload bytes, summed
    over its stages): the peak and the mean over the steps of its first attempt."""
    per_step: dict[int, int] = {}
    for rank in (0, 1):
        rows = [r for r in _read_jsonl(root / f"bytes-{group}-{rank}.jsonl") if r["attempt"] == 0]
        # From the first step on: a group that healed at its start carries its peer's counter (checkpoint state).
        previous = rows[0]["bytes"] if rows else 0
        for row in rows[1:]:
            per_step[row["step"]] = per_step.get(row["step"], 0) + row["bytes"] - previous
            previous = row["bytes"]
    if not per_step:
        return None
    values = list(per_step.values())
    return {"peak": max(values), "mean": round(sum(values) / len(values), 1), "steps": len(values)}


def _late_loss(steps: list[dict], last: int = 20) -> float | None:
    """Mean train loss of the run's last ``last`` steps (one micro-batch's loss per step is noisy)."""
    end = max((s["step"] for s in steps), default=0)
    tail = [s["loss"] for s in steps if s["step"] > end - last]
    return round(sum(tail) / len(tail), 4) if tail else None


def _whole_job(root: Path, args: argparse.Namespace, kill_at: int, name: str) -> dict:
    env = _env() | {"REPLICA_GROUP_ID": "0"}
    start = time.time()
    proc = _torchrun(root, 4, "whole-job", args, kill_at, 1, env)
    code = proc.wait(timeout=args.timeout)
    wall = time.time() - start
    steps, starts = _read_jsonl(root / "steps-0.jsonl"), _read_jsonl(root / "starts-0.jsonl")
    row = {
        "run": name, "ok": code == 0 and bool(steps) and steps[-1]["step"] == args.steps,
        "wall_s": round(wall, 1), "goodput_steps_per_s": round(2 * args.steps / wall, 3),
        "late_loss": {0: _late_loss(steps)}, "loss": {0: [(s["step"], round(s["loss"], 4)) for s in steps]},
    }  # fmt: skip
    killed = root / "killed.json"
    back = next((s for s in starts if s["attempt"] > 0), None)
    if killed.exists() and back is not None:
        kill = json.loads(killed.read_text())
        row.update(kill=kill, kill_to_restored_s=round(back["at"] - kill["at"], 1), resumed_at_step=back["step"],
                   steps_lost_per_replica=kill["step"] - back["step"])  # fmt: skip
    return row


def _plot(rows: list[dict], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in rows:
        for group, curve in row["loss"].items():
            if curve:
                xs, ys = [], []
                for step, loss in curve:  # a gap (a group that was down) stays a gap
                    if xs and step > xs[-1] + 1:
                        xs.append(float("nan"))
                        ys.append(float("nan"))
                    xs.append(step)
                    ys.append(loss)
                ax.plot(xs, ys, label=f"{row['run']}, group {group}", lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (last micro-batch of the step)")
    ax.legend(fontsize=8)
    PLOTS.mkdir(exist_ok=True)
    fig.savefig(PLOTS / name, dpi=110, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--sync-every", type=int, default=10, help="DiLoCo's H")
    parser.add_argument("--kill-at", type=int, default=40)
    parser.add_argument("--chaos", type=float, default=0.0, help="seconds of random kills (a chaos run instead)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--quick", action="store_true", help="a short kill run (240 steps, kill at 20, H=4)")
    parser.add_argument("--workdir", help="keep the runs' files (logs, records, weights) here instead of a temp dir")
    args = parser.parse_args()
    if args.quick:
        # The live group must still run when the killed one is back (its restart took 22 s here, while the
        # live group, alone on the CPU, ran 100 steps): 240 steps, kill at 20.
        args.steps, args.kill_at, args.sync_every = 240, 20, 4
    if shutil.which("torchft_lighthouse") is None:
        raise SystemExit("torchft_lighthouse not found: pip install 'lit-efficient[fault-tolerance]'")
    before, t0 = machine(), time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.workdir or scratch

        def fresh(name: str) -> Path:
            root = Path(tmp, name)
            root.mkdir(parents=True)
            (root / "train.py").write_text(_SCRIPT)
            return root

        if args.chaos:
            root = fresh("chaos")
            rows.append(_summary(root, _groups(root, "chaos", args, 0, 100, chaos_s=args.chaos), args, "chaos"))
        else:
            root = fresh("nofault")
            rows.append(_summary(root, _groups(root, "nofault", args, 0, 0), args, "no fault"))
            root = fresh("healed")
            rows.append(_summary(root, _groups(root, "healed", args, args.kill_at, 1), args, "healed"))
            root = fresh("streaming")
            run = _groups(root, "streaming", args, 0, 0)
            rows.append(_summary(root, run, args, "no fault, streaming", end_equal=False))
            rows.append(_whole_job(fresh("whole-nofault"), args, 0, "whole job, no fault"))
            rows.append(_whole_job(fresh("whole"), args, args.kill_at, "whole-job restart"))
        for row in rows:
            print(json.dumps({k: v for k, v in row.items() if k != "loss"}), flush=True)
    suffix = "_chaos" if args.chaos else "_quick" if args.quick else ""
    _plot(rows, f"fault_tolerance{suffix}.png")
    config = {"steps": args.steps, "sync_every": args.sync_every, "kill_at": args.kill_at, "chaos_s": args.chaos}
    path = write_json(f"fault_tolerance{suffix}.json", envelope("fault_tolerance", args.quick, before, config, t0,
                                                                 runs=rows))  # fmt: skip
    print(f"written to {path}")


if __name__ == "__main__":
    main()
