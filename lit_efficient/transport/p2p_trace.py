"""Evidence that the pipeline's point-to-point order cannot hang on NCCL, gathered without a GPU.

gloo progresses every transfer on its own, so a CPU run completes whatever order the ranks issue their
operations in. NCCL does not. ProcessGroupNCCL runs the operations between two ranks of one group on one
communicator, in issue order, on one stream, for both directions; a receive completes only once the
peer's matching send runs, and a send above NCCL's internal buffering (a few MiB: GPT-2 Medium's boundary
tensor is 64 MiB) completes only once the peer's matching receive runs too. Two ranks that each queue a
receive ahead of the send the other waits for are deadlocked, though gloo would finish the same program.

This module owns the two halves of the check:

- **Recording.** With ``LIT_EFFICIENT_P2P_TRACE=<dir>`` in the environment, `transport` (the only package
  that talks to the network) appends every operation it issues and every wait it blocks on to
  ``<dir>/rank<R>.jsonl``, in program order: which peer, which group, how many bytes, whether the
  operation would run on the device communicator on a GPU (payloads, tied gradients, averaging) or on
  the gloo header group (headers always do). Off by default; when off it costs one attribute test.
- **Replay** (`replay`, pure): runs the recorded programs of every rank under NCCL's rule instead of
  gloo's: per communicator and rank a FIFO stream, a receive done when its send runs, a send above
  ``eager_bytes`` done only when its receive runs, a collective done when every member has it at the
  head, the first operation on a communicator a host-blocking rendezvous of its members (communicators
  are created lazily, at first use), and every wait blocking the rank's later operations (ProcessGroupNCCL
  makes each new operation wait for the compute stream, which waited for the awaited work). A program
  that cannot finish raises `P2PDeadlockError` naming every stuck rank, what it waits for and what
  blocks it. The default ``eager_bytes=0`` treats every send as a rendezvous: the strictest case, and
  the real one for boundary tensors of any size that matters.

The tests record real multi-process runs (both schedules, S=2/4/8, tied weights, validation mid-window,
checkpoints) and replay them; the same traces replayed with both directions of a link on one
communicator (the layout before `process.LinkGroups`) deadlock, which keeps the check honest.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_ENV = "LIT_EFFICIENT_P2P_TRACE"


# -- recording (used by the transport) -------------------------------------------------------------------------


class Recorder:
    """Appends one rank's operations and waits to ``<directory>/rank<R>.jsonl`` as they happen.

    Lines are written (and flushed) one at a time, so a rank that dies leaves its trace up to its death.

    Args:
        directory: Where the rank's file goes (created if missing).
        rank: The global rank recording.
    """

    def __init__(self, directory: str | os.PathLike, rank: int) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(directory) / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - lives with the process
        self._ids = itertools.count()
        self._open: dict[int, int] = {}  # id(work) -> operation id, until the work is waited on

    def issue(self, work: Any, kind: str, peer: int | None, group: str, ranks: Iterable[int], nbytes: int,
              device: bool, role: str, what: str) -> None:  # fmt: skip
        """Record an operation just issued: ``kind`` is ``send``, ``recv`` or ``all_reduce``."""
        op = next(self._ids)
        self._open[id(work)] = op
        self._write(dict(event="issue", id=op, kind=kind, peer=peer, group=group, ranks=sorted(ranks),
                         bytes=nbytes, device=device, role=role, what=what))  # fmt: skip

    def wait(self, work: Any) -> None:
        """Record that the rank blocks on ``work`` now."""
        op = self._open.pop(id(work), None)
        if op is not None:
            self._write(dict(event="wait", id=op))

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")


_recorder: Recorder | None = None
_checked = False


def recorder(rank: Callable[[], int]) -> Recorder | None:
    """This process's recorder if ``LIT_EFFICIENT_P2P_TRACE`` is set (read once, at the first operation)."""
    global _recorder, _checked
    if not _checked:
        _checked = True
        directory = os.environ.get(TRACE_ENV)
        if directory:
            _recorder = Recorder(directory, rank())
    return _recorder


# -- replay (pure) ------------------------------------------------------------------------------------


class P2PDeadlockError(RuntimeError):
    """The recorded programs cannot all finish under NCCL's ordering rule."""


class P2PMismatchError(ValueError):
    """Matched operations disagree (sizes), or an operation is never matched."""


@dataclass(frozen=True)
class Op:
    """One recorded operation of one rank."""

    rank: int
    id: int
    kind: str  # "send", "recv" or "all_reduce"
    peer: int | None
    group: str
    ranks: tuple[int, ...]
    nbytes: int
    device: bool
    role: str
    what: str

    def describe(self) -> str:
        """Like ``rank 1: recv 'activations of micro-batch 3' from rank 2 (group 4, 1024 B)``."""
        where = {"send": f" to rank {self.peer}", "recv": f" from rank {self.peer}"}.get(self.kind, "")
        return f"rank {self.rank}: {self.kind} {self.what!r}{where} (group {self.group}, {self.nbytes} B)"


Program = list[tuple[str, int]]  # ("issue" | "wait", operation id), in program order


def load_traces(directory: str | os.PathLike) -> tuple[dict[int, Program], dict[tuple[int, int], Op]]:
    """Read every ``rank<R>.jsonl`` of ``directory``: each rank's program and every operation by (rank, id)."""
    programs: dict[int, Program] = {}
    ops: dict[tuple[int, int], Op] = {}
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        rank = int(path.stem[4:])
        program: Program = []
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "issue":
                ops[(rank, rec["id"])] = Op(rank, rec["id"], rec["kind"], rec["peer"], rec["group"],
                                            tuple(rec["ranks"]), rec["bytes"], rec["device"], rec["role"],
                                            rec["what"])  # fmt: skip
            program.append((rec["event"], rec["id"]))
        programs[rank] = program
    if not programs:
        raise FileNotFoundError(f"no rank*.jsonl trace in {directory}: was {TRACE_ENV} set for the run?")
    return programs, ops


def by_group(op: Op) -> tuple:
    """The communicator ProcessGroupNCCL uses: one per group and pair of ranks (point-to-point), one per
    group (collectives)."""
    if op.kind == "all_reduce":
        return ("collective", op.group)
    return ("pair", op.group, min(op.rank, op.peer), max(op.rank, op.peer))  # type: ignore[type-var]


def by_role(op: Op) -> tuple:
    """The communicators of a layout with one group per role (``p2p``, ``tied``) carrying both directions:
    what the package had before `process.LinkGroups`."""
    if op.kind == "all_reduce":
        return ("collective", op.role, op.ranks)
    return ("pair", op.role, min(op.rank, op.peer), max(op.rank, op.peer))  # type: ignore[type-var]


@dataclass
class _State:
    op: Op
    comm: tuple
    match: tuple[int, int] | None = None
    index: int = 0  # collectives: how many this rank issued on the communicator before this one
    issued: bool = False
    done: bool = False


def replay(
    programs: Mapping[int, Program],
    ops: Mapping[tuple[int, int], Op],
    *,
    eager_bytes: int = 0,
    lazy_init: bool = True,
    communicator: Callable[[Op], tuple] = by_group,
) -> int:
    """Run every rank's program under NCCL's ordering rule (module docstring); returns the operations run.

    Args:
        programs: Per rank, its issues and waits in program order (`load_traces`).
        ops: Every operation by (rank, id).
        eager_bytes: Sends of at most this many bytes complete without their receive (NCCL's buffering).
        lazy_init: Whether a rank's first operation on a communicator waits for every member's first.
        communicator: Which communicator an operation runs on (`by_group`: ProcessGroupNCCL's).

    Raises:
        P2PDeadlockError: Some rank can never finish; the message names who waits for what.
        P2PMismatchError: A send and its receive differ in size, or an operation has no partner.
    """
    states = {key: _State(op, communicator(op)) for key, op in ops.items()}
    _match(states)
    pcs = dict.fromkeys(programs, 0)
    streams: dict[tuple[int, tuple], deque[tuple[int, int]]] = defaultdict(deque)  # (rank, comm) -> FIFO
    arrived: dict[tuple, set[int]] = defaultdict(set)  # comm -> members that reached their first op on it
    members = {st.comm: _members(st.op) for st in states.values()}

    def advance(rank: int) -> bool:
        program, moved = programs[rank], False
        while pcs[rank] < len(program):
            event, op_id = program[pcs[rank]]
            st = states[(rank, op_id)]
            if event == "wait":
                if not st.done:
                    return moved
            elif st.op.device:
                if lazy_init and rank not in arrived[st.comm]:
                    arrived[st.comm].add(rank)
                if lazy_init and not members[st.comm] <= arrived[st.comm]:
                    return moved  # blocked creating the communicator until every member gets here
                st.issued = True
                streams[(rank, st.comm)].append((rank, op_id))
            else:
                st.issued = True  # gloo: progresses on its own once both ends are issued
                if states[st.match].issued:  # type: ignore[index]
                    st.done = states[st.match].done = True  # type: ignore[index]
            pcs[rank] += 1
            moved = True
        return moved

    def complete() -> bool:
        moved = False
        changed = True
        while changed:
            changed = False
            for stream in streams.values():
                while stream and _head_done(stream[0], states, streams, eager_bytes):
                    stream.popleft()
                    changed = moved = True
        return moved

    while True:
        progressed = any([advance(rank) for rank in programs])
        progressed |= complete()
        if not progressed:
            break
    stuck = [rank for rank, pc in pcs.items() if pc < len(programs[rank])]
    pending = [st for st in states.values() if not st.done]
    if stuck or pending:
        raise P2PDeadlockError(_explain(stuck, pending, programs, pcs, states, streams))
    return len(states)


def _members(op: Op) -> frozenset[int]:
    return frozenset(op.ranks) if op.kind == "all_reduce" else frozenset((op.rank, op.peer))  # type: ignore[arg-type]


def _match(states: dict[tuple[int, int], _State]) -> None:
    """Pair the k-th send from a to b on a communicator with the k-th receive at b from a on it, and the
    k-th collective of every member of a communicator with each other's."""
    queues: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    collectives: dict[tuple, int] = defaultdict(int)  # (communicator, rank) -> collectives so far
    for key in sorted(states):  # operation ids grow in issue order on each rank
        op = states[key].op
        if op.kind == "send":
            queues[("send", states[key].comm, op.rank, op.peer)].append(key)
        elif op.kind == "recv":
            queues[("recv", states[key].comm, op.peer, op.rank)].append(key)
        else:
            states[key].index = collectives[(states[key].comm, op.rank)]
            collectives[(states[key].comm, op.rank)] += 1
    for (kind, comm, src, dst), sends in list(queues.items()):
        if kind != "send":
            continue
        recvs = queues.get(("recv", comm, src, dst), [])
        for s, r in zip(sends, recvs, strict=False):
            a, b = states[s], states[r]
            if a.op.nbytes != b.op.nbytes:
                raise P2PMismatchError(f"{a.op.describe()} is received as {b.op.describe()}: sizes differ")
            a.match, b.match = r, s
        if len(sends) != len(recvs):
            extra = (sends if len(sends) > len(recvs) else recvs)[min(len(sends), len(recvs))]
            raise P2PMismatchError(f"{states[extra].op.describe()} has no matching operation on rank "
                                   f"{dst if extra in sends else src}")  # fmt: skip
    for key in [k for k in queues if k[0] == "recv"]:
        _, comm, src, dst = key
        if ("send", comm, src, dst) not in queues:
            raise P2PMismatchError(f"{states[queues[key][0]].op.describe()} has no matching send on rank {src}")


def _head_done(key, states, streams, eager_bytes: int) -> bool:
    """Whether the operation at the head of its stream completes now (and marks it, and its partner, done)."""
    st = states[key]
    if st.done:
        return True
    if st.op.kind == "all_reduce":
        return _collective_done(st, states, streams)
    partner = states[st.match]
    partner_at_head = partner.issued and _at_head(st.match, partner.comm, streams)
    if st.op.kind == "send":
        if st.op.nbytes <= eager_bytes or partner_at_head:
            st.done = True
            partner.done = partner.done or partner_at_head  # a rendezvous finishes both ends at once
    elif partner.done or partner_at_head:  # a receive: its send has run, or runs now
        st.done = partner.done = True
    return st.done


def _collective_done(st: _State, states, streams) -> bool:
    heads = []
    for member in _members(st.op):
        stream = streams.get((member, st.comm))
        if not stream:
            return False
        head = states[stream[0]]
        if head.index != st.index:
            return False
        if head.op.nbytes != st.op.nbytes:
            raise P2PMismatchError(f"{st.op.describe()} meets {head.op.describe()}: sizes differ")
        heads.append(head)
    for head in heads:
        head.done = True
    return True


def _at_head(key: tuple[int, int], comm: tuple, streams) -> bool:
    stream = streams.get((key[0], comm))
    return bool(stream) and stream[0] == key


def _explain(stuck, pending, programs, pcs, states, streams) -> str:
    lines = []
    for rank in stuck:
        event, op_id = programs[rank][pcs[rank]]
        st = states[(rank, op_id)]
        if event == "wait":
            line = f"rank {rank} waits for {st.op.describe()}"
            stream = streams.get((rank, st.comm)) if st.op.device else None
            if stream and stream[0] != (rank, op_id):
                line += f", queued behind {states[stream[0]].op.describe()}"
            if st.match is not None:
                partner = states[st.match]
                if not partner.issued:
                    line += f"; its partner is not issued yet ({partner.op.describe()})"
                elif partner.op.device:
                    head = streams.get((partner.op.rank, partner.comm))
                    if head and head[0] != st.match:
                        line += f"; its partner is queued behind {states[head[0]].op.describe()}"
        else:
            line = f"rank {rank} blocks creating the communicator of {st.op.describe()} until its peer uses it"
        lines.append(line)
    if not stuck:
        lines += [f"never completes: {st.op.describe()}" for st in pending[:8]]
    return "point-to-point deadlock under NCCL's ordering rule: " + "; ".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m lit_efficient.transport.nccl_check DIR``: replay a recorded run; exit status 1 on a deadlock."""
    import argparse

    parser = argparse.ArgumentParser(
        description="Replay a run recorded with LIT_EFFICIENT_P2P_TRACE=DIR under NCCL's rule."
    )
    parser.add_argument("directory", help="the folder the run's ranks wrote rank<R>.jsonl to")
    parser.add_argument("--eager-bytes", type=int, default=0, help="sends up to this size complete unreceived")
    args = parser.parse_args(argv)
    programs, ops = load_traces(args.directory)
    try:
        ran = replay(programs, ops, eager_bytes=args.eager_bytes)
    except (P2PDeadlockError, P2PMismatchError) as err:
        print(err)
        return 1
    print(f"{len(programs)} ranks, {ran} operations: no deadlock under NCCL's ordering rule")
    return 0
