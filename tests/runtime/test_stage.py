"""One stage in one process: keep-graph on stock PyTorch, normalization, accumulation state."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lit_efficient.runtime.interpreter import PipelineRuntime
from lit_efficient.runtime.stage import PipelineStage, _preserve_versions, run_layers
from lit_efficient.tools.corpus import embedded_corpus
from lit_efficient.tools.demo import batches, build_layers, lm_loss


def test_stock_torch_refuses_backward_after_in_place_step_and_version_restore_allows_it():
    """The mechanism keep-graph PACI relies on, proven on the installed torch."""
    layer = nn.Linear(4, 4)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(2, 4, requires_grad=True)

    out = layer(x).tanh().sum()
    with torch.no_grad():
        layer.weight.add_(1.0)  # an optimizer step between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()

    out = layer(x).tanh().sum()
    layer.weight.grad = torch.ones_like(layer.weight)
    with _preserve_versions(list(layer.parameters())):
        opt.step()
    out.backward()  # accepted: the graph now reads the updated weight (PACI's bounded drift)
    assert x.grad is not None and torch.isfinite(x.grad).all()


def _single_stage(accumulate: int, normalize: str = "mean", schedule: str = "paci") -> PipelineRuntime:
    layers = build_layers(n_layer=1, dim=16, heads=2, block=8)
    opt = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=0.1)
    stage = PipelineStage(layers, 0, 1, opt, lm_loss, normalize=normalize)
    return PipelineRuntime(stage, schedule, accumulate, lambda b: b[0])


def _reference(data, accumulate: int, weights=None):
    layers = build_layers(n_layer=1, dim=16, heads=2, block=8)
    opt = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=0.1)
    windows = [data[i : i + accumulate] for i in range(0, len(data), accumulate)]
    for window in windows:
        w = [weights(b) for b in window] if weights else [1.0] * len(window)
        for batch, wj in zip(window, w, strict=True):
            x = batch[0]
            for layer in layers:
                x = layer(x)
            (lm_loss(x, batch)[0] * wj / sum(w)).backward()
        opt.step()
        opt.zero_grad()
    return [p for layer in layers for p in layer.parameters()]


def _masked(batch, keep: int):
    x, y = batch
    y = y.clone()
    y[:, keep:] = -1  # different token counts per micro-batch
    return x, y


def _loss_ignoring(logits, batch):
    target = batch[1]
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-1)
    return loss, (target != -1).sum()


@pytest.mark.parametrize("schedule", ["paci", "1f1b_flush"])
def test_one_stage_partial_window_is_normalized_by_its_true_size(schedule):
    data = list(itertools.islice(batches(embedded_corpus(50_000), 8, 2, 0), 7))  # windows of 3: 3 + 3 + 1
    runtime = _single_stage(3, schedule=schedule)
    for j, b in enumerate(data):
        runtime.feed(b, j)
    runtime.drain(step_partial_window=True)
    for a, b in zip(runtime.stage.parameters(), _reference(data, 3), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert runtime.stage.stats.steps == 3


def test_tokens_mode_weighs_micro_batches_by_item_count():
    raw = list(itertools.islice(batches(embedded_corpus(50_000), 8, 2, 0), 4))
    data = [_masked(b, keep) for b, keep in zip(raw, (8, 2, 5, 1), strict=True)]
    layers = build_layers(n_layer=1, dim=16, heads=2, block=8)
    opt = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=0.1)
    stage = PipelineStage(layers, 0, 1, opt, _loss_ignoring, normalize="tokens")
    runtime = PipelineRuntime(stage, "paci", 4, lambda b: b[0])
    for j, b in enumerate(data):
        runtime.feed(b, j)
    runtime.drain()
    ref_layers = build_layers(n_layer=1, dim=16, heads=2, block=8)
    ref_opt = torch.optim.SGD([p for layer in ref_layers for p in layer.parameters()], lr=0.1)
    # One batch holding all 4 micro-batches: the mean over every unmasked token of the window.
    x = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    for layer in ref_layers:
        x = layer(x)
    _loss_ignoring(x, (None, y))[0].backward()
    ref_opt.step()
    for a, b in zip(stage.parameters(), [p for layer in ref_layers for p in layer.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tokens_mode_without_item_count_says_what_to_return():
    layers = build_layers(n_layer=1, dim=16, heads=2, block=8)
    stage = PipelineStage(layers, 0, 1, None, lambda out, b: lm_loss(out, b)[0], normalize="tokens")
    runtime = PipelineRuntime(stage, "paci", 2, lambda b: b[0])
    with pytest.raises(ValueError, match="return \\(loss, num_items\\)"):
        runtime.feed(next(batches(embedded_corpus(50_000), 8, 2, 0)), 0)


def test_accumulation_state_round_trip_resumes_a_window():
    data = list(itertools.islice(batches(embedded_corpus(50_000), 8, 2, 0), 4))
    whole = _single_stage(4)
    for j, b in enumerate(data):
        whole.feed(b, j)
    whole.drain()

    first = _single_stage(4)
    for j, b in enumerate(data[:2]):
        first.feed(b, j)
    first.drain()  # mid-window: gradients stay accumulated
    state = {k: v for k, v in first.stage.accumulation_state().items()}
    second = _single_stage(4)
    second.stage.load_accumulation_state(state)
    for j, b in enumerate(data[2:], start=2):
        second.feed(b, j)
    second.drain()
    for a, b in zip(second.stage.parameters(), whole.stage.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert second.stage.stats.steps == 1
    # The window's micro-batch count (what a staleness correction reads as the share accumulated) travels with it;
    # a checkpoint from before the count takes it from the window's weight (normalize="mean": one per micro-batch).
    assert state["microbatches"] == 2
    for saved in (state, {k: v for k, v in state.items() if k != "microbatches"}):
        third = _single_stage(4)
        third.stage.load_accumulation_state(saved)
        assert third.stage._window_microbatches == 2
    assert second.stage._window_microbatches == 0  # reset by the step


def test_runtime_rejects_a_jump_with_micro_batches_in_flight():
    layers = build_layers(n_layer=1, dim=16, heads=2, block=8)
    stage = PipelineStage(layers[:1], 0, 2, None, None)
    sink = {"send": lambda *a: None, "prepost": lambda *a: None, "flush": lambda self: None, "connect": lambda *a: None}
    runtime = PipelineRuntime(stage, "paci", 2, lambda b: b[0], comm=type("Sink", (), sink)())  # type: ignore[arg-type]
    batch = next(batches(embedded_corpus(50_000), 8, 2, 0))
    runtime.feed(batch, 0)
    with pytest.raises(RuntimeError, match="still in flight"):
        runtime.feed(batch, 5)


def test_a_layer_failing_on_its_input_is_named_with_what_it_got():
    """A token id at or above the vocabulary failed as a bare "IndexError: index out of range in self" from inside
    the embedding; a layer's failure now names the layer and its input, for integer ids their range."""
    from lit_efficient.models import GPT

    layers = GPT(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16).pipeline_layers()
    ids = torch.tensor([[1, 2, 3, 64]])
    with pytest.raises(IndexError, match=r"pipeline layer 0 \(GPTEmbedding\) failed on input \(Tensor\(1, 4\) int64 "
                                         r"in \[1, 64\]\): index out of range"):  # fmt: skip
        run_layers(layers, (ids,))
    with pytest.raises(RuntimeError, match=r"pipeline layer 1 \(Block\) failed on input \(Tensor\(1, 4, 8\)\)"):
        run_layers(layers[1:], (torch.zeros(1, 4, 8),), first_layer=1)


class _PassesAnInt(nn.Module):
    """A layer that hands the next one a Python value along with its hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x), 3


@pytest.mark.parametrize("recompute", [False, True])
def test_a_python_value_sent_to_the_next_stage_is_named_with_its_layer(recompute):
    """Only tensors (or None) cross a stage boundary. A Python int there failed inside the transport: "'int' object
    has no attribute 'dtype'" on processes, "... no attribute 'detach'" in one process (plain Lightning trains it)."""
    stage = PipelineStage([nn.Linear(4, 4), _PassesAnInt()], 0, 2, None, None, recompute=recompute, first_layer=1)
    said = r"pipeline layer 2 \(_PassesAnInt\), the last of stage 0, returned a value of type int, not a tensor, "
    said += r"at position 1 of its output \(3\)"
    with pytest.raises(TypeError, match=said + r": only tensors \(or None\) cross a stage boundary"):
        stage.forward(0, (torch.ones(2, 4),))
    with pytest.raises(TypeError, match=said):
        stage.evaluate((torch.ones(2, 4),))
    last = PipelineStage([_PassesAnInt()], 1, 2, None, lambda out, batch: out[0].sum())
    assert last.forward(0, (torch.ones(2, 4),)).shape == ()  # on the last stage it goes to pipeline_loss, as a user's


class _ReturnsADict(nn.Module):
    def forward(self, x):
        return {"hidden": x, "mask": x > 0}


def test_a_dict_sent_to_the_next_stage_is_answered_with_a_tuple():
    """A dict (or list) at a boundary got the advice for a Python number ("return it as torch.tensor(value)")."""
    stage = PipelineStage([_ReturnsADict()], 0, 2, None, None)
    said = r"returned a value of type dict, not a tensor, at position 0 of its output \(keys \['hidden', 'mask'\]\): "
    said += r"only tensors \(or None\) cross a stage boundary. Return its tensors as a tuple instead \(unpacked into"
    with pytest.raises(TypeError, match=said):
        stage.evaluate((torch.ones(2, 4),))


def test_a_low_precision_gradient_is_divided_by_the_exact_count_a_chunk_at_a_time(monkeypatch):
    """bf16/fp16 gradients are divided in float32 and rounded once (a device divisor read in bf16 is 507 as 508), a
    bounded chunk at a time: a whole float32 copy of a large gradient was GBs at the step (the second review)."""
    from lit_efficient.runtime import stage as stage_module

    monkeypatch.setattr(stage_module, "_CHUNK", 7)  # several chunks of a small gradient
    g = torch.randn(5, 9).to(torch.bfloat16)
    strided = torch.randn(9, 5).to(torch.bfloat16).t()  # not contiguous: divided whole
    want = [(x.float() / 507).to(torch.bfloat16) for x in (g, strided)]
    assert not torch.equal(want[0], (g.float() / 508).to(torch.bfloat16))  # the test tells 507 from 508
    count = torch.tensor(507.0, dtype=torch.float64)
    stage_module.divide_by_count([g, strided], count)
    assert torch.equal(g, want[0]) and torch.equal(strided, want[1])
