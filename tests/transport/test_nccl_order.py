"""The pipeline's point-to-point order, replayed under NCCL's rule (lit_efficient.transport.p2p_trace).

gloo finishes any order of issue, so CPU runs alone prove nothing about NCCL. These tests record the
operations real multi-process runs issue (the bare runtime at S=2/4/8 and the Trainer at S=2/4, both
schedules, tied weights, evaluation and checkpoints in the middle of a window) and replay them with
NCCL's per-communicator FIFO streams, every send a rendezvous and communicators created at first use.
The same traces with both directions of a link on one communicator (the layout before LinkGroups)
must deadlock, or the replay would prove nothing either.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_efficient import GradientAccumulation, PACIStrategy
from lit_efficient.models import GPT
from lit_efficient.runtime.interpreter import PipelineRuntime
from lit_efficient.runtime.partition import partition_uniform, stage_bounds
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.tied import TiedWeight, finish_tied, tie_delay
from lit_efficient.runtime.topology import Topology
from lit_efficient.tools.corpus import embedded_corpus
from lit_efficient.tools.demo import batches, build_layers, lm_loss
from lit_efficient.transport.failures import is_timeout
from lit_efficient.transport.p2p_trace import (
    TRACE_ENV,
    Op,
    P2PDeadlockError,
    P2PMismatchError,
    by_role,
    load_traces,
    replay,
)
from lit_efficient.transport.process import LinkGroups, PointToPoint, TiedExchange
from tests.support.multiproc import spawn, values

# -- the replay on hand-written programs ------------------------------------------------------------------

BIG = 64 << 20  # GPT-2 Medium's boundary tensor: 16 x 1024 x 1024 fp32


def _programs(spec: dict[int, str], nbytes: int = BIG, device: bool = True):
    """Programs from tokens: ``s1``/``r1`` issue a send to / a receive from rank 1 (``s1@g``: on group g,
    default ``p``), ``S1``/``R1`` issue and wait at once, ``w3`` waits for this rank's op 3, ``A@g:0,1``
    an all-reduce of ranks 0 and 1 on group g, waited at once."""
    programs, ops = {}, {}
    for rank, text in spec.items():
        program, ids = [], itertools.count()
        for token in text.split():
            if token[0] == "w":
                program.append(("wait", int(token[1:])))
                continue
            body, _, group = token[1:].partition("@")
            kind = {"s": "send", "r": "recv", "a": "all_reduce"}[token[0].lower()]
            if kind == "all_reduce":
                group, _, members = group.partition(":")
                peer, ranks = None, tuple(int(m) for m in members.split(","))
            else:
                peer = int(body)
                ranks = (rank, peer)
            op = Op(rank, next(ids), kind, peer, group or "p", ranks, nbytes, device, "p2p", token)
            ops[(rank, op.id)] = op
            program.append(("issue", op.id))
            if token[0].isupper():
                program.append(("wait", op.id))
        programs[rank] = program
    return programs, ops


# 1F1B at S=2, N=2 over one link: the first stage sends two activations before its first gradient comes,
# the last stage alternates receive-activation / send-gradient.
FIRST = "s1 s1 R1 s1 R1 R1"
LAST = "R0 s0 R0 s0 R0 s0"


def test_both_directions_on_one_communicator_deadlock_at_the_first_steady_state_step():
    with pytest.raises(P2PDeadlockError) as err:
        replay(*_programs({0: FIRST, 1: LAST}))
    message = str(err.value)
    assert "rank 0 waits for rank 0: recv 'R1'" in message and "queued behind rank 0: send 's1'" in message
    assert "rank 1 waits for rank 1: recv 'R0'" in message


def test_small_messages_pass_through_nccl_buffers():
    assert replay(*_programs({0: FIRST, 1: LAST}, nbytes=1024), eager_bytes=4 << 20) == 12


def test_one_communicator_per_direction_completes():
    first = FIRST.replace("s1", "s1@up").replace("R1", "R1@down")
    last = LAST.replace("R0", "R0@up").replace("s0", "s0@down")
    assert replay(*_programs({0: first, 1: last})) == 12


def test_gloo_progresses_any_order():
    assert replay(*_programs({0: FIRST, 1: LAST}, device=False)) == 12


def test_communicators_created_in_crossed_order_deadlock():
    programs = _programs({0: "S1@a S1@b", 1: "R0@b R0@a"}, nbytes=8)
    assert replay(*programs, eager_bytes=1 << 20, lazy_init=False) == 4
    with pytest.raises(P2PDeadlockError, match="blocks creating the communicator"):
        replay(*programs, eager_bytes=1 << 20)


def test_collectives_in_crossed_order_deadlock():
    programs = _programs({0: "A@x:0,1 A@y:0,1", 1: "A@y:0,1 A@x:0,1"})
    with pytest.raises(P2PDeadlockError):
        replay(*programs, lazy_init=False)
    assert replay(*_programs({0: "A@x:0,1 A@y:0,1", 1: "A@x:0,1 A@y:0,1"})) == 4


def test_unmatched_and_mismatched_operations_are_named():
    with pytest.raises(P2PMismatchError, match="no matching"):
        replay(*_programs({0: "s1 s1", 1: "R0"}))
    programs, ops = _programs({0: "S1", 1: "R0"})
    ops[(1, 0)] = Op(1, 0, "recv", 0, "p", (0, 1), 4, True, "p2p", "R0")
    with pytest.raises(P2PMismatchError, match="sizes differ"):
        replay(programs, ops)


# -- the transport's own rules ------------------------------------------------------------------------


def test_a_device_transport_refuses_both_directions_on_one_group():
    with pytest.raises(ValueError, match="one group per direction"):
        PointToPoint(0, lambda r: r, torch.device("meta"), 60.0)


class _Work:
    def __init__(self) -> None:
        self.waits: list[tuple] = []

    def wait(self, *args) -> bool:
        self.waits.append(args)
        return True


def test_device_payloads_are_waited_on_the_stream_and_headers_with_the_timeout(monkeypatch):
    """A timeout on NCCL work turns on a blocking host wait (no receive could overlap compute)."""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    comm = PointToPoint(0, lambda r: r, torch.device("meta"), 60.0, groups=LinkGroups(object(), object()))
    payload, header = _Work(), _Work()
    comm._wait(payload, 1, 0, "activations", device=True)
    comm._wait(header, 1, 0, "activations", device=False)
    assert payload.waits == [()]
    assert [w[0].total_seconds() for w in header.waits] == [60.0]
    cpu = PointToPoint(0, lambda r: r, torch.device("cpu"), 60.0)
    on_cpu = _Work()
    cpu._wait(on_cpu, 1, 0, "activations", device=True)
    assert len(on_cpu.waits[0]) == 1  # gloo payloads keep the timeout: there is no stream to wait on


@pytest.mark.parametrize(
    ("text", "timeout"),
    [
        ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=RECV, NumelIn=1048576, "
         "NumelOut=1048576, Timeout(ms)=600000) ran for 600043 milliseconds before timing out.", True),
        ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv", True),
        ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:6253", False),
        ("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error", False),
    ],
)  # fmt: skip
def test_timeouts_of_gloo_and_of_the_nccl_watchdog_are_told_from_dead_peers(text, timeout):
    assert is_timeout(RuntimeError(text)) is timeout


# -- recorded runs ------------------------------------------------------------------------------------

MODEL = dict(n_layer=8, dim=16, heads=2, block=8)


def _check(directory) -> dict[str, int | str]:
    """Replay a recorded run as NCCL would run it, and as the one-group-per-role layout would."""
    programs, ops = load_traces(directory)
    ran = replay(programs, ops)
    try:
        replay(programs, ops, communicator=by_role)
        single = "completes"
    except P2PDeadlockError:
        single = "deadlocks"
    return {"ranks": len(programs), "ops": ran, "one_group_per_role": single}


def _bare_run(rank, world, schedule, accumulate, tied, directory):
    """The runtime the strategy drives, on LinkGroups, with an evaluation and a partial window mid-run."""
    import os

    os.environ[TRACE_ENV] = str(directory)
    topo = Topology.for_world(world, world)
    s = topo.stage_of(rank)
    groups = LinkGroups.create()
    tie_links = LinkGroups.create([topo.rank_of(0), topo.rank_of(world - 1)]) if tied else None
    layers = build_layers(**MODEL)
    if tied:
        layers[-1].out.weight = layers[0].tok.weight
    lo, hi = stage_bounds(partition_uniform(len(layers), world))[s]
    params = list({id(p): p for layer in layers[lo:hi] for p in layer.parameters()}.values())
    stage = PipelineStage(layers[lo:hi], s, world, torch.optim.SGD(params, lr=0.1), lm_loss)
    weights = []
    if tied and s in (0, world - 1):
        peer_stage = world - 1 - s
        exchange = TiedExchange(s, topo.rank_of(peer_stage), peer_stage, tie_links, 60.0)  # connects now
        param = layers[0].tok.weight  # on the last stage, its head's copy
        weights = [TiedWeight(param, s == 0, schedule, tie_delay(world, accumulate), exchange)]
        stage.exchange_tied = weights[0]
    comm = PointToPoint(s, topo.stage_of, torch.device("cpu"), 60.0, groups=groups)
    runtime = PipelineRuntime(stage, schedule, accumulate, lambda b: b[0], comm, *topo.neighbours(rank))
    data = list(itertools.islice(batches(embedded_corpus(50_000), MODEL["block"], 2, 0), 4 * accumulate + 2))
    for j, batch in enumerate(data[: 2 * accumulate + 1]):  # two windows and one micro-batch into the third
        runtime.feed(batch, j)
    runtime.drain()  # as before validation: the partial window stays accumulated
    runtime.evaluate((data[0][0][:, :5], data[0][1][:, :5]), 0)  # another shape: the placeholder path
    for j, batch in enumerate(data[2 * accumulate + 1 :], start=2 * accumulate + 1):
        runtime.feed(batch, j)
    runtime.drain(step_partial_window=True)
    finish_tied(weights)
    return s


@pytest.mark.multiproc
@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("schedule", ["paci", "1f1b_flush"])
def test_runtime_order_cannot_deadlock_on_nccl(tmp_path, stages, schedule):
    tied = stages in (2, 4)
    values(spawn(_bare_run, stages, schedule, 2, tied, tmp_path, timeout=240.0))
    result = _check(tmp_path)
    assert result["ranks"] == stages
    assert result["one_group_per_role"] == "deadlocks", result  # the check has teeth on this very trace


def _model() -> GPT:
    return GPT(n_layer=4, n_head=2, n_embd=32, block_size=16, tie_weights=True)


def _trainer_run(tmp_path, stages: int, schedule: str, devices: int) -> None:
    from lit_efficient.data import TextDataModule

    trainer = Trainer(
        accelerator="cpu", devices=devices, max_steps=5, val_check_interval=7, limit_val_batches=2,
        strategy=PACIStrategy(pipeline_stages=stages, schedule=schedule, start_method="forkserver"),
        callbacks=[GradientAccumulation(steps=2), ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = TextDataModule(block_size=16, batch_size=2, max_bytes=60_000)
    trainer.fit(_model(), datamodule=data)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("stages", "schedule", "devices"), [(2, "paci", 2), (2, "1f1b_flush", 2), (4, "paci", 4), (2, "1f1b_flush", 4)]
)
def test_trainer_order_cannot_deadlock_on_nccl(tmp_path, monkeypatch, stages, schedule, devices):
    """Fit with tied embeddings, validation 7 micro-batches in (mid-window), a checkpoint every 3 steps; on
    two replicas too (their gradient all-reduce and the tied all-reduce are collectives of the replay)."""
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "trace"))
    _trainer_run(tmp_path, stages, schedule, devices)
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["epoch=0-step=3.ckpt"]
    result = _check(tmp_path / "trace")
    assert result["ranks"] == devices
    assert result["one_group_per_role"] == "deadlocks", result


def test_the_replay_command_reports_a_recorded_run(tmp_path, capsys):
    from lit_efficient.transport.p2p_trace import main

    programs, ops = _programs({0: FIRST, 1: LAST})
    for rank, program in programs.items():
        lines = []
        for event, op_id in program:
            if event == "wait":
                lines.append(f'{{"event": "wait", "id": {op_id}}}')
                continue
            op = ops[(rank, op_id)]
            lines.append(
                f'{{"event": "issue", "id": {op_id}, "kind": "{op.kind}", "peer": {op.peer}, "group": "{op.group}", '
                f'"ranks": [0, 1], "bytes": {op.nbytes}, "device": true, "role": "p2p", "what": "{op.what}"}}'
            )
        (tmp_path / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    assert main([str(tmp_path)]) == 1
    assert "point-to-point deadlock" in capsys.readouterr().out
    assert main([str(tmp_path), "--eager-bytes", str(BIG)]) == 0
    assert "no deadlock" in capsys.readouterr().out
