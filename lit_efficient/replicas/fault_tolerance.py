"""Fault-tolerant pipeline replicas on torchft: a dead replica group costs itself a few steps, never the run.

A replica group is one whole pipeline of S ranks under its own launcher (torchrun, a SLURM step); torchft's
lighthouse (``torchft_lighthouse``) keeps the quorum of live groups. Every rank has a torchft `Manager` (the
group's rank 0 runs its server); rank s of every live group joins one reconfigurable process group per
quorum, so **stage s of the live groups is stage s's replica dimension**, and a restarted rank s heals from rank
s of a live group: its stage's weights, optimizer, LocalSGD/DiLoCo state, schedulers, step counters and the
data position, all in the in-memory checkpoint the strategy builds for it (docs/DESIGN.md section 9).

The quorum is taken at the LocalSGD/DiLoCo outer sync, at a drained point (every stage of the group at the same
step): `TorchftReplicas.sync` takes the quorum (a joining or lagging rank heals inside it), reduces every hosted
stage's pseudo-gradient or weights over the live groups (torchft's all-reduce: the mean over the participants),
and applies the sync only if the group commits it (`Manager.should_commit`: no error anywhere in the group, at
least ``min_replica_groups`` groups live). A group that died is left out of the next quorum after torchft's
heartbeat timeout; nothing waits for it longer. PACI stays bubble-free between syncs: the drain costs the
pipeline's warm-up (S-1 micro-batch slots) once per ``local_sgd_steps`` windows.

Pure PyTorch and torchft (no Lightning): the strategy gives the state to send and the way to load it.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import urllib.request
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor

from lit_efficient.replicas.averaging import ReplicaAverager
from lit_efficient.transport.collectives import flat_in_place

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable: the lighthouse's address
TIMEOUT_ENV = "TORCHFT_TIMEOUT_SEC"  # torchft's own: a collective's, a commit's, a transfer's bound
GROUP_ENV = "REPLICA_GROUP_ID"  # this group's index, as torchft's examples name it
GROUPS_ENV = "NUM_REPLICA_GROUPS"  # how many groups were launched
_INDEXED = 1024  # group indices below this one are checked to be live once in a quorum (`_check_members`)
DEFAULT_PORT = 29510  # where an address without a port is looked for (torchft's examples' lighthouse port)
START_LIGHTHOUSE = "torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 --bind [::]:{port}"
INSTALL = "pip install 'lit-efficient[fault-tolerance]'  (torchft 0.2)"


def require_torchft() -> Any:
    """The torchft module, or an ImportError that says how to install it."""
    try:
        import torchft
    except ImportError as err:
        raise ImportError(
            f"PACIStrategy(fault_tolerance='torchft') needs torchft, which is not installed: {INSTALL}."
        ) from err
    return torchft


def _env_int(name: str) -> int:
    """An integer environment variable, refused with its name and value (``int()`` named neither)."""
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be an integer (set it to 0, 1, ... for each group).") from None


def _timeout_from_env(default: float) -> float:
    """``$TORCHFT_TIMEOUT_SEC`` where set: torchft's Manager reads it itself, and the process group built here for
    the sync's all-reduce and the heal's transfer obeys the same bound."""
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < math.inf:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} must be a positive number of seconds (torchft's default: 60).")
    return seconds


def group_settings(group_id: int | None, groups: int | None, min_groups: int) -> tuple[int, int]:
    """(this group's index, the number of groups launched) from the arguments or torchft's variables, checked."""
    if group_id is None:
        if GROUP_ENV not in os.environ:
            raise ValueError(
                f"fault_tolerance='torchft' needs this replica group's index: set {GROUP_ENV}=0, 1, ... for each "
                "group's launcher (or pass replica_group_id=)."
            )
        group_id = _env_int(GROUP_ENV)
    if groups is None:
        if GROUPS_ENV not in os.environ:  # a guess would differ between groups, and so would their data shards
            raise ValueError(
                f"fault_tolerance='torchft' needs the number of replica groups launched (each reads its own shard of "
                f"the data): set {GROUPS_ENV} for every group's launcher, or pass replica_groups=."
            )
        groups = _env_int(GROUPS_ENV)
    check_group_range(group_id, groups, min_groups)
    return group_id, groups


def check_group_range(group_id: int | None, groups: int, min_groups: int) -> None:
    """This group's index among the ``groups`` launched, and a quorum size they can reach: at construction where
    the arguments give both, at the launch where the environment gives one."""
    if group_id is not None and not 0 <= group_id < groups:
        raise ValueError(
            f"replica_group_id={group_id} is not one of the {groups} replica groups launched (0..{groups - 1}); "
            f"set replica_groups= (or {GROUPS_ENV}) to the number of groups."
        )
    if not 1 <= min_groups <= groups:
        raise ValueError(
            f"min_replica_groups={min_groups} must be between 1 and the {groups} replica groups launched: with more, "
            "no quorum could ever form. Lower it, or launch more groups (replica_groups=)."
        )


def lighthouse_address(timeout: float = 5.0) -> str:
    """``$TORCHFT_LIGHTHOUSE``, checked to answer: a clear error before training instead of a quorum timeout."""
    address = os.environ.get(LIGHTHOUSE_ENV)
    if not address:
        raise ValueError(
            f"fault_tolerance='torchft' needs the lighthouse's address in {LIGHTHOUSE_ENV} (e.g. "
            f"http://localhost:{DEFAULT_PORT}); start one with: {START_LIGHTHOUSE.format(port=DEFAULT_PORT)}"
        )
    url = urlparse(address if "://" in address else f"http://{address}")
    host, port = url.hostname or "localhost", url.port or DEFAULT_PORT
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(
            f"the torchft lighthouse at {address} ({LIGHTHOUSE_ENV}) does not answer ({err}). Start one there with: "
            f"{START_LIGHTHOUSE.format(port=port)}"
        ) from err
    # With its scheme (torchft refused "host:port" a minute later: "scheme is missing") and the port probed.
    address = f"{url.scheme}://{f'[{host}]' if ':' in host else host}:{port}"
    _warn_unless_a_lighthouse(address, timeout)
    return address


def _warn_unless_a_lighthouse(address: str, timeout: float) -> None:
    """A warning when what answers at ``address`` is not torchft's lighthouse (its HTTP page names it): another
    service on that port (a rendezvous store, say) accepts the connection, and the first quorum then waits
    ``p2p_timeout`` with nothing said. A warning, not a refusal: the page is torchft's to change."""
    try:
        with urllib.request.urlopen(address, timeout=timeout) as page:  # noqa: S310 (the user's own address)
            looks_right = b"lighthouse" in page.read(4096).lower()
    except (OSError, ValueError):  # not HTTP, or an error page
        looks_right = False
    if not looks_right:
        warnings.warn(
            f"what answers at {address} ({LIGHTHOUSE_ENV}) does not look like a torchft lighthouse (its HTTP page "
            "names none); if the first quorum then waits until p2p_timeout, point the variable at the lighthouse.",
            UserWarning,
            stacklevel=3,
        )


class TorchftReplicas:
    """This rank's membership in the live replica groups: its torchft `Manager` and the mean over the groups.

    Args:
        group_id: This replica group's index (a group keeps it across restarts).
        groups: Replica groups launched (each reads its own shard of the data).
        group_rank: This rank within its group (its stage on processes).
        group_size: Ranks in the group (S on processes).
        min_groups: Groups that must be live for a sync to commit (torchft's ``min_replica_size``).
        store: (host, port) of a TCPStore of this group, fresh for this launch (rank 0 serves it).
        state: The state to send to a healing peer rank (called in torchft's quorum thread while this
            rank waits for the quorum).
        load: Loads such a state, received from a live peer rank.
        device: Where the stages' tensors live (a CUDA device gets torchft's NCCL process group).
        quorum_timeout: Longest wait for a quorum, in seconds: a restarted group waits at start for the live
            groups' next sync, up to ``local_sgd_steps`` windows away.
        timeout: Longest wait for a collective, a commit or a checkpoint transfer, in seconds.
        store_server: The group's TCPStore server on its rank 0 (`fresh_store`), kept alive as long as this is.
    """

    def __init__(
        self,
        group_id: int,
        groups: int,
        group_rank: int,
        group_size: int,
        min_groups: int,
        store: tuple[str, int],
        state: Callable[[], Any],
        load: Callable[[Any], None],
        device: torch.device,
        quorum_timeout: float,
        timeout: float = 60.0,
        store_server: Any = None,
    ) -> None:
        torchft = require_torchft()
        lighthouse = lighthouse_address()
        timeout = _timeout_from_env(timeout)
        if device.type != "cuda":  # said at every reconfiguration, about a recorder only NCCL has
            logging.getLogger("torchft.manager").addFilter(_NotAboutNcclFlightRecorder())
        # torch's streaming load of a received state warns that it reads tensors from the transfer's read-only
        # buffer; they are copied into the stages' own tensors as they load.
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning, "torch.distributed")
        pg_class = torchft.ProcessGroupNCCL if device.type == "cuda" else torchft.ProcessGroupGloo
        self.manager = torchft.Manager(
            pg=pg_class(timeout=timedelta(seconds=timeout)),
            load_state_dict=load,
            state_dict=state,
            min_replica_size=min_groups,
            # The quorum is waited for where it is taken (a drained point): a healing rank loads its state in
            # this thread, before the sync's reduce, and takes part in it.
            use_async_quorum=False,
            timeout=timedelta(seconds=timeout),
            quorum_timeout=timedelta(seconds=quorum_timeout),
            connect_timeout=timedelta(seconds=timeout),
            rank=group_rank,
            world_size=group_size,
            store_addr=store[0],
            store_port=store[1],
            lighthouse_addr=lighthouse,
            replica_id=f"lit_efficient_group{group_id}",
            hostname=socket.gethostname(),
        )
        self.group_id = group_id
        self.groups = groups
        self.device = device
        self._store_server = store_server
        self.participants = 0  # live groups in the latest quorum
        self.alone = False  # `ReplicaMean`: even alone, a group reduces (others may join at any quorum)
        self._joined = False  # this rank's members were checked once: a misconfigured newcomer is then the one to stop

    def __call__(self, tensors: list[Tensor]) -> int:
        """The mean over the live groups' same rank, in place (`ReplicaMean`): one all-reduce per dtype; torchft
        divides by the participants and keeps any error for the commit."""
        return flat_in_place(tensors, lambda flat: self.manager.allreduce(flat).wait())

    def sync(self, due: Callable[[], Sequence[ReplicaAverager]]) -> bool:
        """One outer sync over the live groups, at a point every rank of the group takes it: quorum (healing here
        if this rank is behind), reduce the stages ``due()`` names (asked after the quorum, which may have moved
        this rank to the live groups' step; none on a rank whose stage is not due under streaming), commit,
        apply. Returns whether the group committed it; if not, every stage keeps its local weights and its next
        sync covers both intervals."""
        self.manager.start_quorum()
        self.participants = self.manager.num_participants()
        # The live groups' same ranks meet here even with nothing to reduce: a rank healing from another group's
        # rank reads that rank's state in its quorum, which the source serves only until its own commit (with
        # nothing to reduce, the join at a fresh start, a source committed before a slow reader had read it: its
        # read failed after 60 s, HTTP 500, and both groups with it). The meeting checks the quorum's members.
        self._check_members()
        averagers = list(due())
        reduced = [averager.reduce() for averager in averagers]
        committed = self.manager.should_commit()
        if committed:
            for averager, means in zip(averagers, reduced, strict=True):
                averager.apply(means)
        return committed

    def _check_members(self) -> None:
        """Refuse a quorum where this group's index is live twice, or whose groups were launched with different
        numbers of groups: either way two groups read one shard of the data and another shard is never read, and
        torchft, which makes every launch's replica id unique, trains on silently. One all-reduce of a few KB:
        a count per group index (exact below ``_INDEXED``) and the launched group count and its square. The rank
        at its first sync raises (groups launched together all do: the launch is wrong); a rank that synced before
        warns and trains on, as the newcomer stops (one bad launch does not end the groups already training)."""
        members = torch.zeros(_INDEXED + 2, dtype=torch.float64, device=self.device)
        if self.group_id < _INDEXED:
            members[self.group_id] = 1.0
        members[-2:] = torch.tensor([self.groups, self.groups**2], dtype=torch.float64)
        self([members])  # the mean over the participants
        if self.manager.errored() is not None:
            return  # a fault in the all-reduce (the sum is partial): this sync will not commit, the next checks
        total = [round(x) for x in (members * self.participants).tolist()]
        problems = []
        if self.group_id < _INDEXED and total[self.group_id] > 1:
            problems.append(
                f"replica group {self.group_id} is live {total[self.group_id]} times in the torchft quorum: another "
                f"launch was given the same {GROUP_ENV} (replica_group_id), so both read shard {self.group_id} of "
                f"the data and another shard is never read. Give each group's launcher its own index, "
                f"0..{self.groups - 1}."
            )
        counts, squares = total[-2:]
        if counts * counts != squares * self.participants:  # equal only where every count is the same (exact ints)
            problems.append(
                f"the live replica groups were launched with different numbers of groups ({GROUPS_ENV}, "
                f"replica_groups): this group's {self.groups}, the {self.participants} live groups' mean "
                f"{counts / self.participants:g}. Each group reads the shard of the data its index names among that "
                "many: give every group's launcher the same number."
            )
        if problems and not self._joined:
            raise ValueError(" ".join(problems))
        self._joined = True  # checked, and in the quorum: from now on a misconfigured newcomer is the one refused
        for problem in problems:
            warnings.warn(
                f"replica group {self.group_id}: a group that joins the quorum is refused and stops ({problem}); "
                "this group, which synced before it, trains on.",
                stacklevel=2,
            )

    @property
    def step(self) -> int:
        """Syncs committed by this group (torchft's step: what a healing rank catches up to)."""
        return self.manager.current_step()

    def state_dict(self) -> dict[str, int]:
        """torchft's counters, for a checkpoint (a whole-job restart resumes them)."""
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.manager.load_state_dict(state)

    def shutdown(self) -> None:
        """Leave: the lighthouse drops this group after its heartbeat timeout."""
        self.manager.shutdown(wait=False)


class _NotAboutNcclFlightRecorder(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "NCCL flight recorder" not in record.getMessage()


def fresh_store() -> tuple[Any, tuple[str, int]]:
    """A TCPStore for one launch of a group's managers, served by its rank 0 on a free port, and its address
    (for the group's other ranks). Fresh at each launch: a restarted group must not read the manager address its
    previous launch left in a long-lived store (torchrun's keeps its keys across restarts)."""
    from torch.distributed import TCPStore

    store = TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
    return store, (socket.gethostname(), store.port)
