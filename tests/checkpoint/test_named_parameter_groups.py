"""An optimizer given ``named_parameters()`` (torch keeps the names in each group's ``param_names``): the pipeline's
checkpoint holds one device's optimizer, names included, and each resumes the other's.

The stages' groups were matched by every hyper-parameter, names included, so a one-group AdamW saved as one group
per stage: plain Lightning's resume then failed ("loaded state dict has a different number of parameter groups"),
and a stage resumed with the saved group's names of every stage. Both file formats; one process (the merge and the
restore by name are the processes' too)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

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


class _DropsEmptyGroups(GPT):
    """GPT's two groups (decay; no decay: the embeddings, norms, biases), each left out where it would be empty (as
    GPT's own optimizer did)."""

    def configure_optimizers(self):
        tables = {id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        tied_head = {"head.lm_head.weight"} if self.hparams.tie_weights else set()
        named = list(self.named_parameters())
        decay = [p for n, p in named if p.ndim >= 2 and id(p) not in tables and n not in tied_head]
        rest = [p for _, p in named if all(p is not q for q in decay)]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-2)


class _NoDecay(GPT):
    """GPT's own optimizer with weight_decay=0.0: its two groups' settings alike."""

    def __init__(self, **kw) -> None:
        super().__init__(weight_decay=0.0, **kw)


def _resumes_both_ways(tmp_path, cls, fmt, **strategy) -> tuple[list, list]:
    """Each of one device's and the pipeline's checkpoints resumed by the other as one device resumes its own;
    the groups' (size, weight decay) in both files."""
    fit_small_gpt(cls, "auto", 2, save=tmp_path / "plain.ckpt")
    fit_small_gpt(cls, _flush(checkpoint_format=fmt, **strategy), 2, save=tmp_path / "piped.ckpt")
    want = fit_small_gpt(cls, "auto", 3, ckpt=tmp_path / "plain.ckpt").state_dict()
    for how, path in ((_flush(**strategy), tmp_path / "plain.ckpt"), ("auto", one_file(tmp_path / "piped.ckpt"))):
        got = fit_small_gpt(cls, how, 3, ckpt=path).state_dict()
        assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6

    def shape(path) -> list:
        return [(len(g["params"]), g["weight_decay"]) for g in torch.load(path)["optimizer_states"][0]["param_groups"]]

    return shape(tmp_path / "plain.ckpt"), shape(one_file(tmp_path / "piped.ckpt"))


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_stage_without_the_first_group_saves_the_groups_in_one_devices_order(tmp_path, fmt):
    """An optimizer that leaves out an empty group, with the embedding alone on stage 0: that stage holds the
    no-decay group only. The merge took the groups in order of first appearance, stage by stage (no-decay first),
    where one device's optimizer lists decay first: one device refused the pipeline's checkpoint ("a parameter
    group that doesn't match the size of optimizer's group"; with sizes alike it would have swapped the
    hyper-parameters), and the pipeline read one device's with the groups' names swapped."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain, piped = _resumes_both_ways(tmp_path, _DropsEmptyGroups, fmt, balance=[1, 3])
    assert piped == plain and plain[0][1] > 0, (piped, plain)
    assert not [w for w in caught if "build different optimizer groups" in str(w.message)]  # the order is known
    stages = _flush(balance=[1, 3])
    fit_small_gpt(_DropsEmptyGroups, stages, 1)
    assert [len(h.optimizer.param_groups) for h in stages.hosted] == [1, 2]  # the case: stage 0 lacks a group


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_two_groups_of_equal_settings_stay_two(tmp_path, fmt):
    """GPT(weight_decay=0.0): its decay and no-decay groups have equal settings, which the merge matched into one
    group: one device refused the pipeline's checkpoint ("a different number of parameter groups") and the
    pipeline one device's. Stages that build the same groups (GPT keeps an empty one) are matched by position."""
    plain, piped = _resumes_both_ways(tmp_path, _NoDecay, fmt)
    assert piped == plain == [(9, 0.0), (20, 0.0)], (piped, plain)


def test_stages_matched_by_position_or_by_settings_in_every_stages_order():
    from lit_efficient.checkpoint.merge import group_order, merged_groups

    assert merged_groups([["k", "k"], ["k", "k"]]) == [[0, 1], [0, 1]]  # the same groups: by position
    assert merged_groups([["no decay"], ["decay", "no decay"]]) == [[1], [0, 1]]  # every stage's order kept
    assert group_order([["x", "x", "y"]]) == ["x", "y"]  # two equal groups of one stage, where stages differ
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert group_order([["b"], ["c"], ["a", "b"]]) == ["c", "a", "b"]  # no stage orders c: first appearance
        assert group_order([["a", "b"], ["b", "a"]]) == ["a", "b"]  # stages that disagree: first appearance
    assert len(caught) == 2 and all("keeping a group empty" in str(w.message) for w in caught)
