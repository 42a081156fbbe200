"""``PACIStrategy(checkpoint_format="sharded")``: every rank writes its own share into one folder laid out as
Lightning's FSDP checkpoints, Lightning's tool consolidates it, and it resumes on any layout.

The reference is one device: 6 optimizer steps (2 epochs of 3 windows of N=4) without interruption;
checkpoints are taken at step 3, an epoch's end (Lightning restarts a plain dataloader at its epoch's
start), and 1F1B-flush is exactly large-batch SGD. Everything here runs one thread per process, as the
ranks do, so that one device, one process and S processes agree bit for bit (the reduction order of a
matmul depends on the thread count); the bound is 1e-6.
"""

from __future__ import annotations

import runpy
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lit_efficient import GradientAccumulation, PACIStrategy, consolidate_checkpoint
from lit_efficient.checkpoint import sharded_read, sharded_write
from lit_efficient.checkpoint.merge import assemble, names_of_groups, rank_share
from lit_efficient.checkpoint.single_file import load_file, write_atomically
from lit_efficient.models import GPT
from lit_efficient.strategy import stage_checkpoints
from tests.support.checkpoints import FORMATS, SaveBothFormatsAt, one_file
from tests.support.compare import assert_equal as _assert_equal
from tests.support.gpt_runs import gpt_model as _model
from tests.support.gpt_runs import gpt_trainer as _trainer
from tests.support.gpt_runs import max_diff as _max_diff
from tests.support.gpt_runs import ordered_data as _ordered
from tests.support.gpt_runs import text_data
from tests.support.multiproc import SpawnedDDP, spawn, values

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("one_thread")]  # tests/conftest.py


def _sharded(stages: int = 2, **kw) -> PACIStrategy:
    return PACIStrategy(
        pipeline_stages=stages, schedule="1f1b_flush", start_method="forkserver", checkpoint_format="sharded", **kw
    )


def _checkpoint_at_step_3(strategy, devices: int, directory: Path) -> tuple[GPT, Path]:
    model = _model()
    ckpt = ModelCheckpoint(dirpath=directory, every_n_train_steps=3, filename="{step}")
    _trainer(strategy, devices, 3, callbacks=[ckpt], enable_checkpointing=True).fit(model, datamodule=_ordered())
    return model, directory / "step=3.ckpt"


def _consolidate(path: Path) -> Path:
    """What ``python -m lightning.pytorch.utilities.consolidate_checkpoint PATH`` does, run as that module."""
    out = path.with_name(path.name + ".consolidated")
    if out.is_file():  # consolidated by an earlier test; the tool refuses to overwrite
        return out
    argv = sys.argv
    sys.argv = ["consolidate_checkpoint", str(path)]
    try:
        runpy.run_module("lightning.pytorch.utilities.consolidate_checkpoint", run_name="__main__")
    finally:
        sys.argv = argv
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted one-device run, and step-3 sharded checkpoints written by 2 processes and by one."""
    root = tmp_path_factory.mktemp("sharded")
    full = _model()
    _trainer("auto", 1, 6).fit(full, datamodule=_ordered())
    piped, path = _checkpoint_at_step_3(_sharded(), 2, root / "piped")
    local, local_path = _checkpoint_at_step_3(_sharded(), 1, root / "local")
    return {"full": full, "piped": piped, "path": path, "local": local, "local_path": local_path}


def test_every_rank_writes_its_share_and_lightning_consolidates_the_folder(saved):
    path = saved["path"]
    assert path.is_dir() and {p.name for p in path.iterdir()} == {
        ".metadata",
        "meta.pt",
        "__0_0.distcp",
        "__1_0.distcp",
    }
    assert not path.with_name(path.name + ".partial").exists()
    one_file = _consolidate(path)
    loaded = GPT.load_from_checkpoint(one_file)  # one device, no strategy: Lightning's own loader
    assert _max_diff(loaded, saved["piped"]) == 0.0
    assert _max_diff(loaded, saved["full"]) > 1e-3, "step 3 must differ from step 6 for the comparisons to mean much"
    plain = _model()
    plain.load_state_dict(consolidate_checkpoint(path))  # the package's own, straight from the folder
    assert _max_diff(plain, saved["piped"]) == 0.0
    checkpoint = torch.load(one_file, weights_only=True)
    assert checkpoint["global_step"] == 3 and checkpoint["pipeline"]["layout"]["num_stages"] == 2
    # One device's optimizer by name, in one device's order: what Optimizer.load_state_dict matches by position.
    names = [n for g in checkpoint["optimizer_states"][0]["param_groups"] for n in g["params"]]
    assert sorted(names) == sorted(n for n, _ in _model().named_parameters())
    # The one-device file from a one-process run is the same, bit for bit.
    local = torch.load(_consolidate(saved["local_path"]), weights_only=True)
    for key in ("state_dict", "optimizer_states", "lr_schedulers"):
        _assert_equal(local[key], checkpoint[key], key)


@pytest.mark.parametrize(
    ("name", "strategy", "devices", "source"),
    [
        ("2 processes", _sharded, 2, "path"),
        ("4 processes", lambda: _sharded(4), 4, "path"),
        ("2 processes to one process", _sharded, 1, "path"),
        ("one process to 2 processes", _sharded, 2, "local_path"),
    ],
)
def test_a_sharded_checkpoint_resumes_on_any_layout_exactly(saved, name, strategy, devices, source):
    resumed = _model()
    _trainer(strategy(), devices, 6).fit(resumed, datamodule=_ordered(), ckpt_path=str(saved[source]))
    assert _max_diff(resumed, saved["piped"]) > 1e-3, name
    assert _max_diff(resumed, saved["full"]) <= 1e-6, name


def test_a_single_replica_folder_resumes_on_two_replicas(saved):
    """S=2 x dp=2 from the 2-process folder continues like DDP on 2 devices from its consolidated file (the
    same data, split alike; GradientAccumulation makes DDP normalize the partial windows as the pipeline)."""
    want, got = _model(), _model()
    ddp = _trainer(SpawnedDDP(), 2, 6, callbacks=[GradientAccumulation()])
    ddp.fit(want, datamodule=_ordered(), ckpt_path=str(_consolidate(saved["path"])))
    pipelines = _trainer(_sharded(), 4, 6, callbacks=[GradientAccumulation()])
    pipelines.fit(got, datamodule=_ordered(), ckpt_path=str(saved["path"]))
    assert _max_diff(want, saved["piped"]) > 1e-3
    assert _max_diff(got, want) <= 1e-6


def test_the_consolidated_file_resumes_on_one_device(saved):
    resumed = _model()
    _trainer("auto", 1, 6).fit(resumed, datamodule=_ordered(), ckpt_path=str(_consolidate(saved["path"])))
    assert _max_diff(resumed, saved["full"]) <= 1e-6


def test_mid_window_paci_checkpoints_carry_the_same_state_in_both_formats_and_resume_alike(tmp_path):
    """PACI with dropout, saved after micro-batch 10 of windows of 4: the folder holds what the file holds
    (weights, optimizer and schedulers by name, each stage's accumulated gradients, window, version and
    random streams), and the run resumed from either continues alike, on processes and in one process."""

    def paci(fmt: str = "file") -> PACIStrategy:
        return PACIStrategy(pipeline_stages=2, schedule="paci", start_method="forkserver", checkpoint_format=fmt)

    callbacks = [SaveBothFormatsAt(tmp_path, batch_idx=9, prefix="mid")]
    _trainer(paci(), 2, 3, callbacks=callbacks).fit(_model(dropout=0.1), datamodule=_ordered())
    file = load_file(tmp_path / "mid-file.ckpt")
    folder = sharded_read.from_consolidated(torch.load(_consolidate(tmp_path / "mid-sharded.ckpt"), weights_only=True))
    windows = [r["accumulation"].get("window") for r in file["pipeline"]["ranks"].values()]
    assert all(w is not None for w in windows), "the checkpoint must be mid-window on every stage"
    for key in ("state_dict", "lr_schedulers", "global_step"):
        _assert_equal(folder[key], file[key], key)
    for key in ("optimizer_by_name", "ranks", "layout", "param_names"):
        _assert_equal(folder["pipeline"][key], file["pipeline"][key], f"pipeline.{key}")
    resumed = {}
    for name, fmt, devices in [("file", "file", 2), ("folder", "sharded", 2), ("folder, one process", "sharded", 1)]:
        model = _model(dropout=0.1)
        _trainer(paci(), devices, 6).fit(model, datamodule=_ordered(), ckpt_path=str(tmp_path / f"mid-{fmt}.ckpt"))
        resumed[name] = model
    assert _max_diff(resumed["folder"], resumed["file"]) <= 1e-6
    assert _max_diff(resumed["folder, one process"], resumed["file"]) <= 1e-6


def test_a_tied_gpt_folder_holds_one_devices_optimizer_and_resumes_on_both_sides(tmp_path):
    """GPT(tie_weights=True): each stage holds a copy of the table. The consolidated file has one optimizer
    entry for it, as one device's, and resumes on one device as one device's own checkpoint of the same step;
    the pipeline resumes the folder, the head's copy taking its own state (``pipeline.tied_state``)."""

    def fit(strategy, devices, steps, ckpt_path=None, callbacks=()):
        model = _model(tie_weights=True)
        trainer = _trainer(strategy, devices, steps, callbacks=list(callbacks), enable_checkpointing=bool(callbacks))
        trainer.fit(model, datamodule=_ordered(), ckpt_path=ckpt_path)
        return model

    fit("auto", 1, 2, callbacks=[ModelCheckpoint(dirpath=tmp_path / "one", save_last=True)])
    fit(_sharded(), 2, 2, callbacks=[ModelCheckpoint(dirpath=tmp_path / "piped", save_last=True)])
    consolidated = _consolidate(tmp_path / "piped" / "last.ckpt")
    (piped,) = torch.load(consolidated, weights_only=True)["optimizer_states"]
    (one,) = torch.load(tmp_path / "one" / "last.ckpt", weights_only=True)["optimizer_states"]
    assert [len(g["params"]) for g in piped["param_groups"]] == [len(g["params"]) for g in one["param_groups"]]
    assert len(piped["state"]) == len(one["state"])
    want = fit("auto", 1, 3, ckpt_path=tmp_path / "one" / "last.ckpt")
    assert _max_diff(fit("auto", 1, 3, ckpt_path=consolidated), want) <= 1e-6
    assert _max_diff(fit(_sharded(), 2, 3, ckpt_path=tmp_path / "piped" / "last.ckpt"), want) <= 1e-6


def test_another_models_folder_is_refused_on_every_rank_naming_the_keys_it_does_not_have(saved):
    """A user audit: a folder of a 2-block GPT resumed a 1-block one silently (each rank loads only its stage's keys,
    so a strict load never saw the block the model lacks), where one device raises torch's "Unexpected key(s)"."""
    with pytest.raises(Exception, match=r'Unexpected key\(s\) in state_dict: "blocks\.1\.'):
        _trainer(_sharded(), 2, 6).fit(_model(n_layer=1), datamodule=_ordered(), ckpt_path=str(saved["path"]))


class _CountsInputs(GPT):
    """A buffer on the module itself, outside its pipeline layers, that ``pipeline_input`` updates: on processes
    each rank keeps its own copy (stage 0 counts every micro-batch; the last stage, which runs none in training,
    none)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.register_buffer("inputs_seen", torch.zeros(()))

    def pipeline_input(self, batch):
        self.inputs_seen += 1
        return super().pipeline_input(batch)


class _HealsFromItself(Callback):
    """What a torchft peer of the same stage loads (`stage_checkpoints.in_memory`), loaded strictly by this rank."""

    def on_train_end(self, trainer, pl_module) -> None:
        dumped = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        stage_checkpoints.load_weights(trainer.strategy, stage_checkpoints.in_memory(trainer.strategy, dumped), True)


def test_the_modules_own_state_is_the_last_stages_in_both_formats(tmp_path):
    """A user audit: the file kept the last stage's copy of such a buffer and the folder stage 0's, so the two
    formats of one save disagreed. Both now hold the last stage's (global rank 0's, whose model Lightning logs
    from and evaluates), as docs/own-model.md says; a healing peer's state keeps each stage's own copy (the review:
    stage 0's strict load of it missed the key)."""
    L.seed_everything(0)
    model = _CountsInputs(n_layer=2, n_head=2, n_embd=32, block_size=32, warmup_steps=2, max_steps=20)
    save = SaveBothFormatsAt(tmp_path, batch_idx=7, prefix="mid")
    _trainer(_sharded(), 2, 3, callbacks=[save, _HealsFromItself()]).fit(model, datamodule=_ordered())
    seen = {fmt: torch.load(one_file(tmp_path / f"mid-{fmt}.ckpt"))["state_dict"]["inputs_seen"] for fmt in FORMATS}
    assert seen["file"] == seen["sharded"] == 0, seen  # stage 0 had counted 8


def test_a_rank_reads_only_its_stage(saved):
    """Stage 1 of 2 (the last layers) reads its weights and its parameters' optimizer state, nothing else."""
    model = _model()
    keys = [k for k in model.state_dict() if k.startswith("blocks.1.") or k.startswith("head.")]
    names = [n for n, _ in model.named_parameters() if n in keys]
    layout = {"num_stages": 2, "num_replicas": 1, "sizes": [2, 2], "schedule": "1f1b_flush"}
    part = sharded_read.read(saved["path"], keys, names, ["stage1-replica0"], layout)
    assert set(part["state_dict"]) == set(keys)
    mine = {n for n, (_, _, state) in part["pipeline"]["optimizer_by_name"].items() if state}
    assert mine == set(names)
    assert set(part["pipeline"]["ranks"]) == {"stage0-replica0", "stage1-replica0"}
    assert "rng" in part["pipeline"]["ranks"]["stage1-replica0"]


def test_a_crash_while_saving_keeps_the_previous_checkpoint_for_ckpt_path_last(tmp_path, monkeypatch):
    """The second save dies after DCP wrote its data: last.ckpt is still step 1's, whole, and ckpt_path="last"
    resumes it, not the partial folder beside it."""
    real_save = sharded_write.dcp.save
    calls = []

    def dying_save(*args, **kwargs):
        calls.append(1)
        real_save(*args, **kwargs)
        if len(calls) == 2:
            raise OSError("disk gone")

    monkeypatch.setattr(sharded_write.dcp, "save", dying_save)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True, save_top_k=0)
    with pytest.raises(OSError, match="disk gone"):
        _trainer(_sharded(), 1, 3, callbacks=[ckpt], enable_checkpointing=True).fit(_model(), datamodule=_ordered())
    monkeypatch.setattr(sharded_write.dcp, "save", real_save)
    last = tmp_path / "last.ckpt"
    assert sharded_write.is_sharded(last) and (tmp_path / "last.ckpt.partial").is_dir()
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == 1

    class StartsAt(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.step = trainer.global_step

    starts = StartsAt()
    again = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True, save_top_k=0)
    trainer = _trainer(_sharded(), 1, 2, callbacks=[again, starts], enable_checkpointing=True)
    trainer.fit(_model(), datamodule=_ordered(), ckpt_path="last")
    assert starts.step == 1 and trainer.global_step == 2
    assert not (tmp_path / "last.ckpt.partial").exists()  # the next save cleared it


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_save_replaces_a_file_a_folder_or_a_link_and_never_a_links_target(tmp_path, fmt):
    """Either format over the other's (a run that saved the other format under the same name: a file over a folder
    failed with IsADirectoryError) and over a link, which goes while what it pointed at stays."""
    target, kept = tmp_path / "last.ckpt", tmp_path / "step=1.ckpt"
    kept.mkdir()
    for old in ("file", "folder", "link"):
        if old == "file":
            target.write_bytes(b"old")
        elif old == "folder":
            target.mkdir()
            (target / "x").write_bytes(b"old")
        else:
            target.symlink_to(kept.name)
        if fmt == "sharded":
            new = tmp_path / "new"
            new.mkdir()
            (new / "meta.pt").write_bytes(b"new")
            sharded_write.publish(new, target)
            assert (target / "meta.pt").read_bytes() == b"new" and not new.exists()
        else:
            write_atomically({"new": 1}, target)
            assert torch.load(target, weights_only=True) == {"new": 1}
        assert not target.is_symlink() and kept.is_dir()
        assert not target.with_name("last.ckpt.old").exists()
        stage_checkpoints.remove(_sharded(), target)
        assert not target.exists()


def test_a_rotated_last_link_is_removed_not_its_target(tmp_path, monkeypatch):
    """ModelCheckpoint(save_last="link") with a last name per step removes its previous link through the strategy:
    a link to a folder was taken for the folder, rmtree refused a link silently, and the links piled up (pointing
    at folders a top-k rotation removes later)."""
    monkeypatch.setattr(ModelCheckpoint, "CHECKPOINT_NAME_LAST", "last-{step}")
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, save_last="link", filename="{step}")
    _trainer(_sharded(), 1, 3, callbacks=[ckpt], enable_checkpointing=True).fit(_model(), datamodule=_ordered())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last-step=3.ckpt", *(f"step={k}.ckpt" for k in (1, 2, 3))]
    assert (tmp_path / "last-step=3.ckpt").resolve() == (tmp_path / "step=3.ckpt").resolve()


def test_a_folder_missing_another_ranks_share_is_not_published(tmp_path, monkeypatch):
    """Node-local disks: each node's ranks wrote their shares into their own ``PATH.partial``, and global rank 0
    published its folder as complete; the save said nothing, a resume or consolidation later failed on a missing
    file. Here a share DCP's index names is gone from the folder rank 0 sees: the save raises, naming the file and
    the fix, and the previous checkpoint stays in place. A share that shows up late (a network file system's
    cached lookup) is waited for."""
    import threading

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    target = tmp_path / "last.ckpt"
    base, shares, layout = _two_stage_shares()
    sharded_write.save(target, shares, base, layout, distributed=False)
    before = sorted(p.name for p in target.iterdir())
    prepared = sharded_write.prepare(target, shares, base, layout, None, distributed=False)
    with sharded_write.quiet_dcp():
        dcp.save(prepared.tree, storage_writer=FileSystemWriter(prepared.tmp), no_dist=True)
    share = prepared.tmp / "__0_0.distcp"
    written = share.read_bytes()
    share.unlink()  # written where global rank 0 does not see it
    monkeypatch.setattr(sharded_write, "SHARE_PATIENCE_S", 0.0)
    with pytest.raises(RuntimeError, match=r"__0_0\.distcp .*a file system every rank sees .*checkpoint_format='file'"):
        prepared.finish()
    assert sorted(p.name for p in target.iterdir()) == before and (target / "__0_0.distcp").exists()
    late = threading.Timer(0.3, share.write_bytes, args=(written,))
    late.start()
    sharded_write.check_every_share_is_here(prepared.tmp, target, patience=20.0)  # no error: it came
    late.join()


# -- the format without processes: shares in, the single file's dict out --------------------------------


def _two_stage_shares() -> tuple[dict, list[dict], dict]:
    """Shares of a 2-stage split of a tiny model after one AdamW step, mid-window on stage 0."""
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4, bias=False)), nn.Sequential(nn.Linear(4, 2))]
    shares, names_of = [], [["0.weight", "0.bias", "1.weight"], ["2.weight", "2.bias"]]
    for s, part in enumerate(stages):
        matrices = [p for p in part.parameters() if p.dim() > 1]
        vectors = [p for p in part.parameters() if p.dim() == 1]
        opt = torch.optim.AdamW([{"params": matrices}, {"params": vectors, "weight_decay": 0.0}])
        part(torch.randn(2, part[0].in_features)).sum().backward()
        opt.step()
        named = dict(zip(names_of[s], part.parameters(), strict=True))
        module = _Named(named)
        lightning = {"state_dict": {n: p.detach() for n, p in named.items()}, "optimizer_states": [opt.state_dict()],
                     "lr_schedulers": [{"base_lrs": [1e-3] * len(opt.param_groups), "last_epoch": 1}]}  # fmt: skip
        accumulation = {"version": 1, "rng": None}
        if s == 0:
            accumulation.update(window=torch.tensor(2), grads={n: torch.full_like(p, 0.5) for n, p in named.items()})
        extras = {"stage": s, "replica": 0, "accumulation": accumulation, "rng": {"cpu": torch.get_rng_state()}}
        shares.append(rank_share(lightning, names_of_groups(module, opt), extras, True))
    base = {"global_step": 1, "loops": {}, "callbacks": {}, "lr_schedulers": shares[-1]["lr_schedulers"]}
    layout = {"num_stages": 2, "num_replicas": 1, "sizes": [2, 1], "schedule": "paci"}
    return base, shares, layout


class _Named:
    def __init__(self, named):
        self.named = named

    def named_parameters(self):
        return iter(self.named.items())


def test_the_folder_gives_back_the_single_files_dict(tmp_path):
    base, shares, layout = _two_stage_shares()
    sharded_write.save(tmp_path / "c.ckpt", shares, base, layout, distributed=False)
    want = assemble(base, shares, layout)
    every_name = [n for s in shares for g in s["groups"] for n in g]
    keys = list(want["state_dict"])
    got = sharded_read.read(tmp_path / "c.ckpt", keys, every_name, ["stage0-replica0", "stage1-replica0"], layout)
    for key in ("state_dict", "lr_schedulers", "global_step"):
        _assert_equal(got[key], want[key], key)
    for key in ("optimizer_by_name", "ranks", "layout", "param_names"):
        _assert_equal(got["pipeline"][key], want["pipeline"][key], f"pipeline.{key}")
    # The single file loads memory-mapped: its tensors are the file's pages, read where used.
    file = tmp_path / "c.file"
    torch.save(want, file)
    assert _mapped_file(load_file(file)["state_dict"]["0.weight"]) == str(file)


def _mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds the tensor's bytes (Linux: /proc/self/maps), or None."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) == 6 else None
    return None


def test_weights_only_shares_of_diverged_replicas_assemble_in_both_formats(tmp_path):
    """``ModelCheckpoint(save_weights_only=True)`` under LocalSGD with two replicas: each replica sends its own
    weights and no optimizer state. The merge used to name the optimizer's slots only when there was an optimizer,
    so it raised UnboundLocalError on rank 0 (and in the sharded format the other ranks waited in its collectives)."""
    base = {"global_step": 4, "loops": {}, "callbacks": {}}
    layout = {"num_stages": 1, "num_replicas": 2, "sizes": [1], "schedule": "paci"}
    shares = []
    for replica in (0, 1):
        named = {"0.weight": nn.Parameter(torch.full((2, 2), float(replica)))}
        lightning = {"state_dict": {n: p.detach() for n, p in named.items()}}  # weights only: no optimizer_states
        extras = {"stage": 0, "replica": replica, "accumulation": {"version": 4, "rng": None}}
        shares.append(rank_share(lightning, None, extras, True))
    single = assemble(base, shares, layout)
    assert "optimizer_states" not in single
    assert torch.equal(single["state_dict"]["0.weight"], torch.zeros(2, 2))
    assert torch.equal(single["pipeline"]["replicas"]["stage0-replica1"]["state_dict"]["0.weight"], torch.ones(2, 2))
    sharded_write.save(tmp_path / "w.ckpt", shares, base, layout, distributed=False)
    got = sharded_read.read(tmp_path / "w.ckpt", ["0.weight"], ["0.weight"], ["stage0-replica1"], layout)
    own = got["pipeline"]["replicas"]["stage0-replica1"]["state_dict"]["0.weight"]
    assert torch.equal(own, torch.ones(2, 2))  # replica 1 reads its own weights back


def test_a_diverged_replicas_parameter_without_optimizer_state_reads_alike_from_both_formats(tmp_path):
    """LocalSGD with two replicas where replica 1 never stepped one parameter (an expert no token of its data
    reached): the file holds ``{}`` for it. The folder keeps no empty dict, and its reader used to leave the
    name out, so the restore overlaid replica 0's Adam moments on it; both formats now give back ``{}``."""
    base = {"global_step": 1, "loops": {}, "callbacks": {}}
    layout = {"num_stages": 1, "num_replicas": 2, "sizes": [2], "schedule": "paci"}
    shares = []
    for replica in (0, 1):
        torch.manual_seed(0)
        part = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        opt = torch.optim.AdamW(part.parameters(), lr=0.1)
        x = torch.ones(1, 2)
        (part[0](x).sum() + (part[1](x).sum() if replica == 0 else 0)).backward()
        opt.step()
        named = dict(zip(["0.weight", "0.bias", "1.weight", "1.bias"], part.parameters(), strict=True))
        lightning = {"state_dict": {n: p.detach() for n, p in named.items()}, "optimizer_states": [opt.state_dict()],
                     "lr_schedulers": []}  # fmt: skip
        extras = {"stage": 0, "replica": replica, "accumulation": {"version": 1, "rng": None}}
        shares.append(rank_share(lightning, names_of_groups(_Named(named), opt), extras, True))
    want = assemble(base, shares, layout)["pipeline"]["replicas"]["stage0-replica1"]["optimizer_by_name"]
    assert want["1.weight"][2] == {} and want["0.weight"][2]  # never stepped on replica 1; stepped
    sharded_write.save(tmp_path / "r.ckpt", shares, base, layout, distributed=False)
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sharded_read.read(tmp_path / "r.ckpt", names, names, ["stage0-replica1"], layout)
    assert not [w for w in caught if "torch.distributed" in str(w.message)]  # DCP's one-process note, every rank
    _assert_equal(got["pipeline"]["replicas"]["stage0-replica1"]["optimizer_by_name"], want, "replica 1's state")


@pytest.mark.parametrize("devices", [1, 4], ids=["one process", "two replicas"])
def test_a_mid_window_checkpoint_resumes_exactly_each_replica_with_its_own_partial_window(tmp_path, devices):
    """S=2, 1F1B-flush, saved after micro-batch 6 (the second window's third of four): the checkpoint holds each
    rank's partial sums, which replicas reduce only at the step. The resume lost them: Lightning zeroes the module's
    gradients between the restore and the fit loop, so the window stepped on its last micro-batches alone; and with
    two replicas every replica took the last replica's sums. Now the run continues exactly as the uninterrupted one
    (which saved at the same point), in both formats, in one process and on two replicas of two stages."""

    def fit(ckpt_path: str | None = None) -> GPT:
        model = _model()
        saves = [] if ckpt_path else [SaveBothFormatsAt(tmp_path, batch_idx=5, prefix="mid")]
        strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="forkserver")
        _trainer(strategy, devices, 3, callbacks=saves).fit(model, datamodule=text_data(), ckpt_path=ckpt_path)
        return model

    whole = fit()
    if devices == 4:
        saved = load_file(tmp_path / "mid-file.ckpt")["pipeline"]["ranks"]
        grads = [saved[f"stage0-replica{r}"]["accumulation"]["grads"]["embed.wte.weight"] for r in (0, 1)]
        assert not torch.equal(*grads), "the replicas' partial sums must differ for this test to tell them apart"
    for fmt in FORMATS:
        assert _max_diff(fit(str(tmp_path / f"mid-{fmt}.ckpt")), whole) <= 1e-6, fmt


def test_both_formats_are_on_disk_before_they_are_renamed_into_place(tmp_path, monkeypatch):
    """A rename publishes a checkpoint atomically against a crash of the process, not of the machine: without an
    fsync of the content first and of the folder after, a power loss could leave the new name over missing bytes."""
    import os

    from lit_efficient.checkpoint.single_file import write_atomically

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_atomically({"state_dict": {"w": torch.ones(2)}}, tmp_path / "file" / "c.ckpt")
    assert synced == [str(tmp_path / "file" / "c.ckpt.partial"), str(tmp_path / "file")]  # content, then the rename
    synced.clear()
    base, shares, layout = _two_stage_shares()
    sharded_write.save(tmp_path / "folder" / "c.ckpt", shares, base, layout, distributed=False)
    assert str(tmp_path / "folder" / "c.ckpt.partial" / "meta.pt") in synced  # DCP syncs the shares' own files
    assert synced[-1] == str(tmp_path / "folder")  # the rename, last


def test_a_folders_meta_is_lightnings_state_at_the_save_not_at_the_write(tmp_path):
    """A background save writes meta.pt later, on its thread; the callbacks' state it holds (ModelCheckpoint's
    best_k_models, say) is a live object Lightning changes before the next save, so it is pickled at the save."""
    base, shares, layout = _two_stage_shares()
    base["callbacks"] = {"ModelCheckpoint": {"best_k_models": {"step=1.ckpt": 2.0}}}
    prepared = sharded_write.prepare(tmp_path / "c.ckpt", shares, base, layout, None, distributed=False)
    base["callbacks"]["ModelCheckpoint"]["best_k_models"]["step=2.ckpt"] = 1.5  # Lightning, before the write ends
    sharded_write.dcp.save(prepared.tree, storage_writer=sharded_write.FileSystemWriter(prepared.tmp), no_dist=True)
    prepared.finish()
    meta = torch.load(tmp_path / "c.ckpt" / sharded_write.META, weights_only=True)
    assert meta["callbacks"]["ModelCheckpoint"]["best_k_models"] == {"step=1.ckpt": 2.0}


def _local_sgd_folder_resumed_on_another_layout(rank: int, world: int, root: str) -> list[str]:
    warnings.filterwarnings("ignore")
    strategy = PACIStrategy(pipeline_stages=1, local_sgd_steps=4, checkpoint_format="sharded")
    trainer = _trainer(strategy, world, 3)  # between syncs: each replica's own weights are in the folder
    trainer.fit(_model(), datamodule=_ordered())
    trainer.save_checkpoint(Path(root, "apart"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        other = PACIStrategy(pipeline_stages=1, local_sgd_steps=4, schedule="1f1b_flush")  # another layout
        _trainer(other, world, 3).fit(_model(), datamodule=_ordered(), ckpt_path=str(Path(root, "apart")))
    return [str(w.message) for w in seen if "resuming a checkpoint of layout" in str(w.message)]


def test_a_local_sgd_folder_on_another_layout_says_the_replicas_own_are_dropped(tmp_path):
    """Rank 0 (the first replica) reads no replica's own record from a folder: the warning is decided from what every
    rank reads (the saved layout and averagers), as from a file."""
    said = values(spawn(_local_sgd_folder_resumed_on_another_layout, 2, str(tmp_path), timeout=240, torchrun_env=True))
    assert len(said[0]) == 1 and "the replicas past the first start from the first's weights" in said[0][0], said[0]


def test_a_logger_that_uploads_checkpoints_is_warned_that_it_skips_folders(tmp_path):
    """WandbLogger(log_model=True) uploads the files ModelCheckpoint wrote (Lightning's scan keeps files only): with
    checkpoint_format="sharded" the run ended with no model uploaded and nothing said (a W&B audit). The check reads
    a logger's ``_log_model``, WandbLogger's and MLflow's: a CSV logger that sets it stands in for them, since a real
    W&B run started in a test worker keeps its settings for every later test there (one did, and a later offline-run
    test found its variables ignored)."""
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    assert WandbLogger(log_model=True, offline=False, save_dir=str(tmp_path))._log_model is True  # no run started

    class Uploading(CSVLogger):
        _log_model = True

    for fmt, warned in (("sharded", 1), ("file", 0)):
        saves = ModelCheckpoint(dirpath=tmp_path / fmt)
        strategy = PACIStrategy(pipeline_stages=2, checkpoint_format=fmt)
        logger = Uploading(tmp_path, name=fmt)
        trainer = _trainer(strategy, 1, 2, logger=logger, callbacks=[saves], enable_checkpointing=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.fit(_model(), datamodule=_ordered())
        said = [str(w.message) for w in seen if "log_model" in str(w.message)]
        assert len(said) == warned, said
        assert all("checkpoint_format='sharded' writes each as a folder, so Uploading uploads no model" in s
                   for s in said)  # fmt: skip
