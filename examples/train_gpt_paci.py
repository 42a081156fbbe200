"""Train a small GPT with a 2-stage PACI pipeline through the Python API (docs/DESIGN.md's user contract).

    python examples/train_gpt_paci.py

Two processes (one pipeline stage each) on CPU: the script is re-run once per rank (PACIStrategy's
default ``start_method="popen"``, the same launch torchrun and SLURM do), which is why everything
happens under ``if __name__ == "__main__"``. Measured: 8 minutes wall time on 2 CPU cores shared with
another job (200 optimizer steps of 4 micro-batches of 16 x 256 bytes, blocks recomputed in backward, GPT's
default lr 3e-4 with 100 warmup steps), ending at train loss 2.71 nats per byte (the corpus' byte-unigram
entropy is 3.30 nats). configs/quickstart.yaml gets further in less time with shorter sequences and a
higher learning rate.

Rank 0 then samples 200 bytes after the prompt "def " from the trained model (whole again there after fit).
The offline W&B run lands in runs/wandb/ (``wandb sync`` it later); the pipeline metrics of
`PipelineMonitor` (utilization, bubble, drift, throughput, memory) are in it.
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import WandbLogger

from lit_efficient import ActivationCheckpointing, GradientAccumulation, PACIStrategy, PipelineMonitor
from lit_efficient.cli.app import keep_wandb_local
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT


def main() -> None:
    keep_wandb_local("runs", offline=True)  # W&B's cache and logs under runs/wandb, not in ~/.cache
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=200,
        strategy=PACIStrategy(pipeline_stages=2, schedule="paci"),
        callbacks=[GradientAccumulation(steps=4), ActivationCheckpointing(), PipelineMonitor()],
        logger=WandbLogger(project="lit-efficient", offline=True, save_dir="runs"),
    )  # fmt: skip
    model = GPT(n_layer=4, n_embd=128)
    trainer.fit(model, datamodule=TextDataModule())
    if trainer.is_global_zero:  # rank 0 holds the last stage (the loss) and, after fit, the whole trained model
        print(f"final train loss {float(trainer.callback_metrics['train_loss']):.3f} nats per byte")
        sample = model.generate(torch.tensor([list(b"def ")]), max_new_tokens=200, temperature=0.8)[0]
        print(bytes(sample.tolist()).decode("utf-8", errors="replace"))  # byte-level: the tokens are the bytes


if __name__ == "__main__":
    # No options; --help prints the above instead of starting the run.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
