"""Multi-node launches, exercised on one machine: docs/multi-node.md's torchrun and SLURM commands.

Two "nodes" of one process each run a 2-stage pipeline whose stages sit on different nodes. Each
launch trains a few 1F1B-flush steps and must end with the weights one device reaches on the same
batches (one replica keeps the user's data order), so the cluster environment, the rank layout
across nodes and the rendezvous all did what a single-node run does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lit_efficient import PACIStrategy
from tests.support.gpt_runs import gpt_model as _model
from tests.support.gpt_runs import gpt_trainer as _trainer
from tests.support.gpt_runs import max_diff as _max_diff
from tests.support.gpt_runs import text_data as _data
from tests.support.multiproc import _free_port

pytestmark = pytest.mark.multiproc

STEPS = 3
REPO = Path(__file__).resolve().parents[2]
_SCRIPT = textwrap.dedent(
    f"""
    import sys
    import torch
    sys.path.insert(0, {str(REPO)!r})
    from lit_efficient import PACIStrategy
    from tests.support.gpt_runs import text_data as _data, gpt_model as _model, gpt_trainer as _trainer

    if __name__ == "__main__":
        strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", p2p_timeout=60)
        trainer = _trainer(strategy, 1, {STEPS}, num_nodes=2)
        model = _model()
        trainer.fit(model, datamodule=_data())
        env = type(trainer.strategy.cluster_environment).__name__
        if trainer.global_rank == 0:  # rank 0 holds the whole model after fit
            torch.save({{"state_dict": model.state_dict(), "env": env}}, sys.argv[1])
    """
)


@pytest.fixture(scope="module")
def one_device():
    model = _model()
    _trainer("auto", 1, STEPS).fit(model, datamodule=_data())
    return model


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MPLCONFIGDIR=str(tmp_path / "mpl"))
    return env


def _wait(procs: list[subprocess.Popen], timeout: float = 240) -> None:
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-6000:]


def _check(result: Path, one_device, environment: str) -> None:
    saved = torch.load(result, weights_only=True)
    assert saved["env"] == environment
    trained = _model()
    trained.load_state_dict(saved["state_dict"])
    assert _max_diff(trained, _model()) > 1e-3
    assert _max_diff(trained, one_device) <= 1e-5


@pytest.mark.command
def test_two_torchrun_agents_with_c10d_rendezvous(tmp_path, one_device):
    script, result = tmp_path / "train.py", tmp_path / "weights.pt"
    script.write_text(_SCRIPT)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=lit",
                str(script),
                str(result),
            ],
            cwd=tmp_path,
            env=_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    _wait(procs)
    _check(result, one_device, "TorchElasticEnvironment")


@pytest.mark.command
def test_srun_style_launch_with_slurm_variables(tmp_path, one_device):
    """What srun sets for 2 nodes x 1 task: Lightning's SLURMEnvironment reads ranks and the rendezvous."""
    script, result = tmp_path / "train.py", tmp_path / "weights.pt"
    script.write_text(_SCRIPT)
    port = _free_port()
    procs = []
    for task in (0, 1):
        env = _env(tmp_path)
        env.update(
            SLURM_JOB_ID="4242", SLURM_JOB_NAME="lit-efficient", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1",
            SLURM_NNODES="2", SLURM_NODELIST="127.0.0.1", SLURM_PROCID=str(task), SLURM_LOCALID="0",
            SLURM_NODEID=str(task), MASTER_PORT=str(port),
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(result)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
    _wait(procs)
    _check(result, one_device, "SLURMEnvironment")


class _RecordRank(Callback):
    """Writes what a rank sees at the start of training: an environment variable, its thread count and
    whether any of its parameters still share memory with another process."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        seen = {
            "mark": os.environ.get("LIT_EFFICIENT_TEST_MARK"),
            "port": os.environ.get("MASTER_PORT"),
            "threads": torch.get_num_threads(),
            "shared": any(p.is_shared() for p in pl_module.parameters()),
        }
        Path(self.out, f"rank-{trainer.global_rank}.json").write_text(json.dumps(seen))


def test_forkserver_ranks_see_the_launching_process_as_it_is_now(tmp_path, monkeypatch):
    """start_method="forkserver" starts ranks like "spawn" does, not like "fork" (Lightning's treatment): a
    forkserver is started once per process, so its ranks would see the environment of the first fit (a
    stale MASTER_PORT, a stale seed) and, on CPU, share the module's parameter memory with each other.
    Two fits with a changed environment in between; each must see its own, with private parameters."""
    # Neither the suite's 1 (tests/conftest.py) nor torch's default of one per core: the ranks must read it now.
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    for fit, mark in enumerate(("first", "second")):
        monkeypatch.setenv("LIT_EFFICIENT_TEST_MARK", mark)
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))
        out = tmp_path / mark
        out.mkdir()
        strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="forkserver")
        model = _model()
        _trainer(strategy, 2, 1, callbacks=[_RecordRank(out)]).fit(model, datamodule=_data())
        seen = [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(2)]
        want = {"mark": mark, "port": os.environ["MASTER_PORT"], "threads": 3, "shared": False}
        assert seen == [want, want], f"fit {fit}"
