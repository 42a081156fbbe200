"""A user's ``DataLoader(shuffle=True)`` without a generator, passed to fit, under one replica.

Its ``RandomSampler`` draws its permutation's seed from the process's global torch stream when the epoch
starts. The README promises that with one data-parallel replica "every stage reads your own training loader
as it is (its sampler, its shuffling), so the pipeline sees exactly the batches one device would". Before
the fix, Lightning's re-seed at setup (``reset_seed`` in DDP's ``setup_distributed``, copied for one process)
replaced the stream the model's construction had advanced, so the pipeline read another order than one
device; and without ``seed_everything`` the ranks of a pipeline each drew their own permutation, so the last
stage took the loss of one batch's outputs against another batch's targets, silently.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lit_efficient import PACIStrategy
from lit_efficient.models import GPT
from tests.support.modules import LayerList


class _Batches(Callback):
    def __init__(self, out: Path | None = None) -> None:
        self.seen: list[int] = []
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(int(batch[0].sum()))

    def on_train_end(self, trainer, pl_module) -> None:
        if self.out is not None:
            Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (48, 8), generator=g)
    return DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=2, shuffle=True)  # no generator: global stream


def _own_draws_loader() -> DataLoader:
    """Data drawn from a generator the process seeds from the OS: another batch on every rank that builds it."""
    x = torch.from_numpy(np.random.default_rng().integers(0, 256, (48, 8)))
    return DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=2)


class _OwnOrderFromTheSecondPass(torch.utils.data.Sampler):
    """The dataset in order on its first pass; on later ones a permutation from a generator each process seeds from
    the OS (an epoch's reshuffle the ranks draw apart): the stages agree on the first epoch only."""

    def __init__(self, n: int) -> None:
        self.n, self.passes = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.passes += 1
        order = range(self.n) if self.passes == 1 else np.random.default_rng().permutation(self.n).tolist()
        return iter(order)


def _reshuffled_apart_loader() -> DataLoader:
    data = _loader().dataset
    return DataLoader(data, batch_size=2, sampler=_OwnOrderFromTheSecondPass(len(data)))


class _TwoValidationSets(GPT):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", self.pipeline_loss(self(self.pipeline_input(batch)), batch)[0])


def _two_validation_sets() -> list[DataLoader]:
    """The first agrees across the ranks; the second each rank draws on its own."""
    return [_loader(), _own_draws_loader()]


def _fit(seed: bool, callback: Callback, loader=_loader, val=None, module=GPT, **kw) -> None:
    if seed:
        L.seed_everything(0)
    model = module(n_layer=2, n_head=2, n_embd=32, block_size=8, vocab_size=256, warmup_steps=1, max_steps=4)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=4, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **kw,
    )  # fmt: skip
    trainer.fit(model, loader(), val() if val else None)


@pytest.mark.usefixtures("one_thread")
def test_one_process_pipeline_reads_the_loader_as_one_device_does() -> None:
    single, piped = _Batches(), _Batches()
    _fit(True, single, devices=1)
    _fit(True, piped, devices=1, strategy=PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"))
    assert len(single.seen) == 8
    assert piped.seen == single.seen


REPO = Path(__file__).resolve().parents[2]
_SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from lit_efficient import PACIStrategy
from tests.strategy.test_loader_random_stream import _Batches, _fit, _loader
from tests.strategy.test_loader_random_stream import _own_draws_loader, _reshuffled_apart_loader
from tests.strategy.test_loader_random_stream import _TwoValidationSets, _two_validation_sets

if __name__ == "__main__":
    out = Path(sys.argv[1])
    # The default start_method, "popen": every rank runs this script, as under torchrun. First a fit without
    # seed_everything, in processes fresh as a user's (each rank's stream is its own draw), then one with it (one
    # launch for all: the later fits run on the ranks the first started).
    for seed in (False, True):
        strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush")
        _fit(seed, _Batches(out / ("seed" if seed else "noseed")), devices=2, strategy=strategy)
    # Then data each rank draws on its own: every rank must refuse it at the first batch, naming the cause; for
    # training data (after the sanity check's validation batches, which agree), for validation data, and for an
    # epoch's reshuffle the ranks draw apart (the first epoch of 2 windows agrees, the second does not).
    rank = os.environ.get("LOCAL_RANK", "0")
    cases = (
        ("train", dict(loader=_own_draws_loader, val=_loader)), ("val", dict(val=_own_draws_loader)),
        ("epoch", dict(loader=_reshuffled_apart_loader, limit_train_batches=4)),
        ("val2", dict(val=_two_validation_sets, module=_TwoValidationSets)),  # each loader's first batch
    )
    for kind, loaders in cases:
        try:
            _fit(True, _Batches(), devices=2, strategy=PACIStrategy(pipeline_stages=2), **loaders)
        except RuntimeError as err:
            (out / f"refused_{{kind}}{{rank}}.txt").write_text(str(err))
"""


@pytest.mark.multiproc
@pytest.mark.command
def test_every_stage_reads_the_batches_one_device_reads(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT.format(repo=str(REPO)))
    for seed in ("seed", "noseed"):
        (tmp_path / seed).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_", "PL_"))}
    for var in ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE"):  # left by an earlier in-process fit:
        env.pop(var, None)  # Lightning would take the script for a rank that torchrun started
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MPLCONFIGDIR=str(tmp_path / "mpl"))
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for r in range(2):  # a pipeline fed other batches on each stage trained on mismatched pairs, silently
        for kind, batches in (("train", "training batches"), ("val", "validation batches"),
                              ("epoch", "training batches of epoch 1"),
                              ("val2", "validation batches of dataloader 1")):  # fmt: skip
            refused = (tmp_path / f"refused_{kind}{r}.txt").read_text()
            assert f"read different first {batches}: stage 0 (rank 1) and stage 1 (rank 0)" in refused, refused
    for seed in ("noseed", "seed"):
        ranks = [json.loads(Path(tmp_path, seed, f"rank{r}.json").read_text()) for r in range(2)]
        assert len(ranks[0]) == 8
        assert ranks[0] == ranks[1], f"{seed}: the stages of one pipeline read different batches"
    # One device after seed_everything(0) reads the same order in any process: this one's. Without
    # seed_everything one device's order is a fresh draw: nothing to compare the pipeline's with.
    single = _Batches()
    _fit(True, single, devices=1)
    assert ranks[0] == single.seen


def test_a_batch_digest_sees_every_byte_shape_and_key_and_no_object_address() -> None:
    from lit_efficient.strategy.trainer_glue import batch_fingerprint

    ids = torch.arange(12).reshape(3, 4)
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "note": "row", "meta": object()}
    same = {"input_ids": ids.clone(), "labels": ids.roll(-1, 1).clone(), "note": "row", "meta": object()}
    assert batch_fingerprint(batch) == batch_fingerprint(same)  # two processes' objects differ by address only
    one_byte = dict(same, labels=same["labels"].clone().index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(7)))
    for other in (
        one_byte,
        dict(same, input_ids=ids.reshape(4, 3)),
        dict(same, note="row2"),
        {"inputs": ids, "labels": ids.roll(-1, 1), "note": "row", "meta": None},
        (ids, ids.roll(-1, 1)),
    ):
        assert batch_fingerprint(other) != batch_fingerprint(batch), other
    sparse = torch.eye(3).to_sparse()  # a layout without contiguous bytes: digested as its dense values
    assert batch_fingerprint(sparse) == batch_fingerprint(torch.eye(3).to_sparse())
    assert batch_fingerprint(sparse) != batch_fingerprint((2 * torch.eye(3)).to_sparse())
    assert batch_fingerprint(torch.zeros(2, dtype=torch.bfloat16)) != batch_fingerprint(torch.zeros(2))


@dataclasses.dataclass
class _Pair:
    ids: torch.Tensor
    labels: torch.Tensor


def test_a_batch_digest_sees_inside_dataclasses_hugging_face_encodings_and_numpy_arrays() -> None:
    """A user audit: stages whose loader drew its order from the OS were refused for dict and tuple batches, but
    a dataclass, Hugging Face's BatchEncoding (its collators' batch) and numpy arrays were opaque to the digest:
    two processes' different batches trained on, stage 0's inputs scored against the other batch's labels."""
    from transformers import BatchEncoding

    from lit_efficient.strategy.trainer_glue import batch_fingerprint

    ids = torch.arange(12).reshape(3, 4)
    other = ids.flip(0)
    alike = [
        (_Pair(ids, ids + 1), _Pair(ids.clone(), ids + 1), _Pair(other, other + 1)),
        (
            BatchEncoding({"input_ids": ids}),
            BatchEncoding({"input_ids": ids.clone()}),
            BatchEncoding({"input_ids": other}),
        ),
        ({"ids": ids.numpy()}, {"ids": ids.numpy().copy()}, {"ids": other.numpy()}),
        (np.array(["a", "b"], dtype=object), np.array(["a", "b"], dtype=object), np.array(["a", "c"], dtype=object)),
        ({"n": np.int64(3)}, {"n": np.int64(3)}, {"n": np.int64(4)}),
        ({"tags": {"x", "y"}}, {"tags": {"y", "x"}}, None),  # unordered: compared by type alone
    ]
    for batch, same, different in alike:
        assert batch_fingerprint(batch) == batch_fingerprint(same), batch
        if different is not None:
            assert batch_fingerprint(batch) != batch_fingerprint(different), (batch, different)
    assert batch_fingerprint(_Pair(ids, ids)) != batch_fingerprint((ids, ids))  # the container's type counts
    # The review: a structured array with an object field hashed its addresses; a cycle recursed without end.
    record = [("s", object), ("i", int)]
    assert batch_fingerprint(np.array([("a" * 3, 1)], dtype=record)) == batch_fingerprint(
        np.array([("".join(["a", "aa"]), 1)], dtype=record)
    )
    parent = _Pair(ids, ids)
    parent.labels = [parent]
    assert batch_fingerprint(parent) == batch_fingerprint(parent)


# -- the streams after an evaluation: only the last stage ran the user's steps -----------------------------------


class _Augmented(torch.utils.data.Dataset):
    """Each sample with noise from the global torch stream (a random augmentation, no loader workers), the noise's
    sums kept in ``drawn``."""

    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
        self.drawn: list[float] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = torch.randn(4)
        self.drawn.append(float(noise.sum()))
        return self.x[i] + 0.3 * noise, self.y[i]


class _SamplesWhileValidating(LayerList):
    """Two layers; ``validation_step`` draws from the global stream (a sample from a prior that a generative model
    logs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()),
                                           torch.nn.Linear(8, 3)])  # fmt: skip

    def pipeline_loss(self, out, batch):
        return torch.nn.functional.cross_entropy(out, batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("sample", torch.randn(()) + self.pipeline_loss(self(batch[0]), batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_sampling_model(devices: int, strategy="auto") -> dict[str, torch.Tensor]:
    """Two epochs validating in the middle and at the end of each, the sanity check as by default."""
    L.seed_everything(0)
    g = torch.Generator().manual_seed(2)
    val = TensorDataset(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g))
    model = _SamplesWhileValidating()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, val_check_interval=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(_Augmented(), batch_size=2), DataLoader(val, batch_size=2))
    return {k: v.clone() for k, v in model.state_dict().items()}  # rank 0: the whole model after fit


def _sampling_on_ranks(rank: int, world: int) -> dict[str, torch.Tensor] | None:
    weights = _fit_sampling_model(world, PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"))
    return weights if rank == 0 else None


def _resume_after_a_validation_end_save(rank: int, world: int, folder: str) -> list[float]:
    """A fit saving at each validation's end (a ModelCheckpoint monitoring validation: its default), then a fit resumed
    from the save after the first validation; what the resumed fit's Dataset drew on this rank."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    drawn = []
    for steps, ckpt_path in ((8, None), (16, f"{folder}/step=4.ckpt")):
        L.seed_everything(0)
        data = _Augmented(32)
        save = ModelCheckpoint(dirpath=folder, filename="{step}", save_top_k=-1, save_on_train_epoch_end=False)
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"),
            max_steps=steps, val_check_interval=4, num_sanity_val_steps=0, logger=False, callbacks=[save],
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        val = TensorDataset(torch.randn(4, 4), torch.randint(0, 3, (4,)))
        trainer.fit(_SamplesWhileValidating(), DataLoader(data, batch_size=1), DataLoader(val, batch_size=2),
                    ckpt_path=ckpt_path)  # fmt: skip
        drawn = data.drawn
    return drawn


@pytest.mark.multiproc
@pytest.mark.usefixtures("one_thread")
def test_random_draws_in_validation_step_leave_every_stage_drawing_what_one_device_draws() -> None:
    """Only the last stage runs the user's validation_step, whose draws advanced its stream alone: stage 0 then
    computed on other augmentations than the ones the last stage scored (silently, in the middle of an epoch; at
    the next epoch the first batches' check refused the run, blaming the data). After an evaluation every stage
    takes the last stage's streams: the run is one device's."""
    from tests.support.multiproc import spawn, values

    piped = values(spawn(_sampling_on_ranks, 2, torchrun_env=True))[0]
    single = _fit_sampling_model(1)
    assert piped.keys() == single.keys()
    for key in single:
        assert torch.equal(piped[key], single[key]), key


@pytest.mark.multiproc
@pytest.mark.usefixtures("one_thread")
def test_a_checkpoint_saved_at_a_validations_end_resumes_with_the_stages_drawing_alike(tmp_path) -> None:
    """Each rank saves its own streams: a ModelCheckpoint saving in on_validation_end ran before the strategy's own
    hook took the last stage's streams, so stage 0's checkpoint held its stream from before, and the resume put it
    back a validation's draws behind the last stage."""
    from tests.support.multiproc import spawn, values

    last_stage, stage_0 = values(spawn(_resume_after_a_validation_end_save, 2, str(tmp_path), torchrun_env=True))
    assert len(last_stage) >= 12 and last_stage == stage_0


class _RandomlyMasked(GPT):
    """A random masking of the input tokens in ``pipeline_input``, drawn from the process's torch stream, in training
    and in GPT's own validation_step alike."""

    def pipeline_input(self, batch):
        x = batch[0]
        return x.masked_fill(torch.rand(x.shape) < 0.25, 0)


def _fit_masked(devices: int, validate: bool) -> dict[str, torch.Tensor]:
    """Three epochs of a shuffled loader (the global stream's), validating at each epoch's end or not at all."""
    L.seed_everything(0)
    model = _RandomlyMasked(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64)
    x = torch.randint(1, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=2, shuffle=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"),
        max_epochs=3, accumulate_grad_batches=2, limit_val_batches=2 if validate else 0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, data, data if validate else None)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _masked_on_ranks(rank: int, world: int) -> list[dict[str, torch.Tensor]] | None:
    runs = [_fit_masked(world, validate) for validate in (False, True)]
    return runs if rank == 0 else None


@pytest.mark.multiproc
@pytest.mark.usefixtures("one_thread")
def test_a_random_pipeline_input_leaves_the_stages_drawing_alike_in_one_process_as_on_processes() -> None:
    """Stage 0 drew the masking from the process's stream in training, so its rank's stream ran ahead of the last
    stage's: at the second epoch their shuffles differed and the first batches' check stopped the run, blaming the
    data. Now it draws from the stage's own stream, as its layers do. In an evaluation, one process drew the masking
    twice (stage 0's and the validation step's own call), on processes once per rank: now once, as one device."""
    from tests.support.multiproc import spawn, values

    piped = values(spawn(_masked_on_ranks, 2, torchrun_env=True))[0]
    for validate, on_processes in zip((False, True), piped, strict=True):
        in_process = _fit_masked(1, validate)
        for key in in_process:
            assert torch.equal(on_processes[key], in_process[key]), (validate, key)
