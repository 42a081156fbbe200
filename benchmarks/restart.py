"""Kill a rank, let torchrun restart the run, count the restarts that resume: the torchrun command itself, N tries.

    python -m benchmarks.restart                  # 10 tries, PACI, file checkpoints
    python -m benchmarks.restart --tries 3 --checkpoint-format sharded
    python -m benchmarks.restart --quick          # 2 tries

Each try runs ``torchrun --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:<free port>`` on a script training a 2-stage `PACIStrategy` GPT (2 x 32, gloo on CPU, one
thread per rank) to step 6 with a ``ModelCheckpoint(every_n_train_steps=1, save_last=True)`` and
``fit(..., ckpt_path="last")``. On the first attempt rank 1 SIGKILLs itself at the end of step 3. A try
succeeds when torchrun exits 0, the restarted attempt resumed from a checkpoint (its first step > 0) and
both ranks ended at step 6. Recovery is the time from the kill to the restarted attempt's
``on_train_start`` (the checkpoint restored: torchrun noticing the death, stopping the survivor, the second
rendezvous, the new workers importing torch and Lightning, forming their groups and loading). A try that
runs past ``--timeout`` counts as a hang. Writes benchmarks/results/restart.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from benchmarks.harness import envelope, machine, write_json

STEPS, KILL_AT = 6, 3
REPO = Path(__file__).resolve().parents[1]
_SCRIPT = textwrap.dedent(
    f"""
    import json, os, signal, sys, time
    from pathlib import Path
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lit_efficient import PACIStrategy
    from lit_efficient.data import TextDataModule
    from lit_efficient.models import GPT

    OUT = Path(sys.argv[1])
    ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

    class Record(Callback):
        def on_train_start(self, trainer, pl_module):
            if trainer.global_rank == 0:
                seen = {{"step": trainer.global_step, "at": time.time()}}
                (OUT / f"start-{{ATTEMPT}}.json").write_text(json.dumps(seen))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if ATTEMPT == 0 and trainer.global_rank == 1 and trainer.global_step == {KILL_AT}:
                (OUT / "killed.json").write_text(json.dumps({{"at": time.time()}}))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_end(self, trainer, pl_module):
            (OUT / f"end-rank{{trainer.global_rank}}.json").write_text(json.dumps({{"step": trainer.global_step}}))

    if __name__ == "__main__":
        L.seed_everything(0, verbose=False)
        ckpt = ModelCheckpoint(dirpath=OUT / "checkpoints", every_n_train_steps=1, save_last=True)
        strategy = PACIStrategy(pipeline_stages=2, checkpoint_format=sys.argv[2], p2p_timeout=60)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps={STEPS}, accumulate_grad_batches=4,
            logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            callbacks=[ckpt, Record()],
        )
        model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=32, warmup_steps=2, max_steps=20)
        data = TextDataModule(block_size=32, batch_size=4, max_bytes=60_000, seed=1)
        trainer.fit(model, datamodule=data, ckpt_path="last")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _try(root: Path, fmt: str, timeout: float) -> dict[str, object]:
    script = root / "train.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", f"--rdzv-id=try-{root.name}",
        str(script), str(root), fmt,
    ]  # fmt: skip
    start = time.time()
    proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        outcome = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        outcome = "hang"
    wall = time.time() - start

    def read(name: str) -> dict | None:
        path = root / name
        return json.loads(path.read_text()) if path.exists() else None

    killed, restarted = read("killed.json"), read("start-1.json")
    ends = [read(f"end-rank{r}.json") for r in (0, 1)]
    resumed = restarted is not None and restarted["step"] > 0
    finished = all(e is not None and e["step"] == STEPS for e in ends)
    ok = outcome == "ok" and killed is not None and resumed and finished
    row: dict[str, object] = {
        "ok": ok, "outcome": outcome, "wall_s": round(wall, 1),
        "resumed_at_step": restarted["step"] if restarted else None,
        "recover_s": round(restarted["at"] - killed["at"], 1) if killed and restarted else None,
    }  # fmt: skip
    if not ok:
        row["log_tail"] = out[-3000:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--checkpoint-format", choices=("file", "sharded"), default="file")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a try counts as a hang")
    parser.add_argument("--quick", action="store_true", help="2 tries")
    args = parser.parse_args()
    tries = 2 if args.quick else args.tries
    before, start = machine(), time.perf_counter()
    rows = []
    for k in range(tries):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp, f"{k}")
            root.mkdir()
            rows.append(_try(root, args.checkpoint_format, args.timeout))
        print(f"try {k}: {json.dumps({key: v for key, v in rows[-1].items() if key != 'log_tail'})}", flush=True)
    ok = [r for r in rows if r["ok"]]
    recover = sorted(float(r["recover_s"]) for r in ok if r["recover_s"] is not None)  # type: ignore[arg-type]
    summary = {
        "successes": len(ok), "tries": tries, "checkpoint_format": args.checkpoint_format,
        "recover_s_median": recover[len(recover) // 2] if recover else None,
        "recover_s_min": recover[0] if recover else None, "recover_s_max": recover[-1] if recover else None,
    }  # fmt: skip
    config = {"steps": STEPS, "kill_at": KILL_AT, "checkpoint_format": args.checkpoint_format, "tries": tries}
    payload = envelope("restart", args.quick, before, config, start, summary=summary, tries=rows)
    suffix = "_quick" if args.quick else "_sharded" if args.checkpoint_format == "sharded" else ""
    path = write_json(f"restart{suffix}.json", payload)
    print(json.dumps(summary))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
