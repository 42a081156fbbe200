"""An optimizer given ``named_parameters()`` (torch keeps the names in each group's ``param_names``): the pipeline's
checkpoint holds one device's optimizer, names included, and each resumes the other's.

The stages' groups were matched by every hyper-parameter, names included, so a one-group AdamW saved as one group
per stage: plain Lightning's resume then failed ("loaded state dict has a different number of parameter groups"),
and a stage resumed with the saved group's names of every stage. Both file formats; one process (the merge and the
restore by name are the processes' too)."""

from __future__ import annotations

import pytest
import torch

from lit_efficient import PACIStrategy
from lit_efficient.models import GPT
from tests.support.checkpoints import fit_small_gpt, one_file

pytestmark = pytest.mark.usefixtures("one_thread")


class _Named(GPT):
    def configure_optimizers(self):
        decay = [(n, p) for n, p in self.named_parameters() if p.ndim >= 2]
        rest = [(n, p) for n, p in self.named_parameters() if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)


def _fit(strategy, steps: int, ckpt=None, save=None) -> _Named:
    return fit_small_gpt(_Named, strategy, steps, ckpt, save)


def _flush(**kw) -> PACIStrategy:
    return PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", **kw)


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_named_parameter_groups_save_as_one_device_and_resume_both_ways(tmp_path, fmt):
    _fit("auto", 2, save=tmp_path / "plain.ckpt")
    _fit(_flush(checkpoint_format=fmt), 2, save=tmp_path / "piped.ckpt")
    plain = torch.load(tmp_path / "plain.ckpt", weights_only=True)["optimizer_states"][0]
    piped = torch.load(one_file(tmp_path / "piped.ckpt"), weights_only=True)["optimizer_states"][0]
    assert [g["param_names"] for g in piped["param_groups"]] == [g["param_names"] for g in plain["param_groups"]]
    assert [len(g["params"]) for g in piped["param_groups"]] == [len(g["params"]) for g in plain["param_groups"]]
    # Each continues the other's run as one device continues its own; each stage keeps its own parameters' names.
    want = _fit("auto", 3, ckpt=tmp_path / "plain.ckpt").state_dict()
    for strategy, path in (("auto", one_file(tmp_path / "piped.ckpt")), (_flush(), tmp_path / "plain.ckpt")):
        got = _fit(strategy, 3, ckpt=path)
        assert max((got.state_dict()[k] - want[k]).abs().max().item() for k in want) < 1e-6
        if isinstance(strategy, PACIStrategy):
            named = {id(p): n for n, p in got.named_parameters()}
            for hosted in strategy.hosted:
                for group in hosted.optimizer.param_groups:
                    assert group["param_names"] == [named[id(p)] for p in group["params"]]


class _HeadApart(GPT):
    """Its own learning rate for the head: the same two groups on every stage, the head's empty on stage 0."""

    def configure_optimizers(self):
        head = [p for n, p in self.named_parameters() if n.startswith("head.")]
        rest = [p for n, p in self.named_parameters() if not n.startswith("head.")]
        optimizer = torch.optim.AdamW([{"params": rest}, {"params": head, "lr": 2e-2, "weight_decay": 0.0}], lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)]


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_group_empty_on_a_stage_resumes(tmp_path, fmt):
    """A stage whose group holds none of its parameters (as the hosting warning advises: the same groups on every
    stage, an empty one is fine) failed every resume with an IndexError. The pipeline resumes its checkpoint as one
    device resumes its own, and one device the pipeline's."""
    fit_small_gpt(_HeadApart, "auto", 2, save=tmp_path / "plain.ckpt")
    saving = _flush(checkpoint_format=fmt)
    fit_small_gpt(_HeadApart, saving, 2, save=tmp_path / "piped.ckpt")
    assert len(saving.hosted[0].optimizer.param_groups[1]["params"]) == 0  # the case: stage 0's head group is empty
    want = fit_small_gpt(_HeadApart, "auto", 3, ckpt=tmp_path / "plain.ckpt").state_dict()
    resumed = _flush()
    for strategy, path in ((resumed, tmp_path / "piped.ckpt"), ("auto", one_file(tmp_path / "piped.ckpt"))):
        got = fit_small_gpt(_HeadApart, strategy, 3, ckpt=path).state_dict()
        assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6
    # The empty group takes the saved group's hyper-parameters, as the stage that holds the head does.
    hyper = [[(g["lr"], g["weight_decay"]) for g in h.optimizer.param_groups] for h in resumed.hosted]
    assert hyper == [[(1e-2, 1e-2), (2e-2, 0.0)]] * 2


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_stage_without_the_first_group_saves_the_groups_in_one_devices_order(tmp_path, fmt):
    """GPT's own optimizer drops an empty group: with the embedding alone on stage 0 that stage holds the no-decay
    group only. The merge took the groups in order of first appearance, stage by stage (no-decay first), where one
    device's optimizer lists decay first: one device refused the pipeline's checkpoint ("a parameter group that
    doesn't match the size of optimizer's group"; with sizes alike it would have swapped the hyper-parameters),
    and the pipeline read one device's with the groups' names swapped. Each now resumes the other's."""
    alone = dict(balance=[1, 3])
    fit_small_gpt(GPT, "auto", 2, save=tmp_path / "plain.ckpt")
    saving = _flush(checkpoint_format=fmt, **alone)
    fit_small_gpt(GPT, saving, 2, save=tmp_path / "piped.ckpt")
    assert [len(h.optimizer.param_groups) for h in saving.hosted] == [1, 2]  # the case: stage 0 lacks a group
    plain = torch.load(tmp_path / "plain.ckpt", weights_only=True)["optimizer_states"][0]["param_groups"]
    piped = torch.load(one_file(tmp_path / "piped.ckpt"), weights_only=True)["optimizer_states"][0]["param_groups"]
    shape = lambda groups: [(len(g["params"]), g["weight_decay"]) for g in groups]  # noqa: E731
    assert shape(piped) == shape(plain) and plain[0]["weight_decay"] > 0, (shape(piped), shape(plain))
    want = fit_small_gpt(GPT, "auto", 3, ckpt=tmp_path / "plain.ckpt").state_dict()
    for strategy, path in ((_flush(**alone), tmp_path / "plain.ckpt"), ("auto", one_file(tmp_path / "piped.ckpt"))):
        got = fit_small_gpt(GPT, strategy, 3, ckpt=path).state_dict()
        assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6


def test_the_group_order_keeps_every_stages_order():
    from lit_efficient.checkpoint.merge import group_order

    assert group_order([["no decay"], ["decay", "no decay"]]) == ["decay", "no decay"]  # the test above's case
    assert group_order([["b"], ["c"], ["a", "b"]]) == ["c", "a", "b"]  # ready groups by first appearance
    assert group_order([["x", "x", "y"]]) == ["x", "y"]  # two equal groups of one stage: one merged group
    assert group_order([["a", "b"], ["b", "a"]]) == ["a", "b"]  # stages that disagree: first appearance
