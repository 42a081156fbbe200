"""Which global rank runs which stage of which data-parallel replica (pure arithmetic).

world_size = num_stages x num_replicas. Each replica's pipeline occupies contiguous ranks, with
its LAST stage on the lowest rank: rank ``r*S`` is the last stage of replica ``r``. Global rank 0
therefore holds the loss and the model's outputs, which is where Lightning logs, shows the progress
bar and evaluates callbacks, so none of that needs extra communication.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """The rank layout of ``num_replicas`` pipelines of ``num_stages`` stages each.

    Args:
        num_stages: Stages per pipeline (S).
        num_replicas: Data-parallel replicas of the pipeline (dp).
    """

    num_stages: int
    num_replicas: int = 1

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.num_replicas < 1:
            raise ValueError(f"num_stages={self.num_stages} and num_replicas={self.num_replicas} must be >= 1")

    @classmethod
    def for_world(cls, world_size: int, num_stages: int) -> Topology:
        """The layout of ``world_size`` ranks into pipelines of ``num_stages``; errors say the fix."""
        if num_stages < 1:
            raise ValueError(f"pipeline_stages={num_stages} must be >= 1")
        if world_size % num_stages:
            raise ValueError(
                f"pipeline_stages={num_stages} does not divide the world size {world_size} "
                f"(devices x nodes): use a divisor of {world_size}, or change devices so that "
                f"world size = pipeline_stages x data-parallel replicas"
            )
        return cls(num_stages, world_size // num_stages)

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas

    def rank_of(self, stage: int, replica: int = 0) -> int:
        """Global rank of ``stage`` in ``replica``."""
        if not (0 <= stage < self.num_stages and 0 <= replica < self.num_replicas):
            raise ValueError(f"no stage {stage} in replica {replica} of a {self.num_replicas}x{self.num_stages} layout")
        return replica * self.num_stages + (self.num_stages - 1 - stage)

    def stage_of(self, rank: int) -> int:
        """Stage run by global ``rank``."""
        return self.num_stages - 1 - rank % self.num_stages

    def replica_of(self, rank: int) -> int:
        """Data-parallel replica that global ``rank`` belongs to."""
        return rank // self.num_stages

    def pipeline_ranks(self, replica: int) -> list[int]:
        """Ranks of ``replica``'s stages, stage 0 first."""
        return [self.rank_of(s, replica) for s in range(self.num_stages)]

    def replica_ranks(self, stage: int) -> list[int]:
        """Ranks that hold ``stage`` in each replica (its data-parallel group), replica 0 first."""
        return [self.rank_of(stage, r) for r in range(self.num_replicas)]

    def neighbours(self, rank: int) -> tuple[int | None, int | None]:
        """Global ranks of the previous and next stage of ``rank``'s pipeline (None at the ends)."""
        stage, replica = self.stage_of(rank), self.replica_of(rank)
        prev = self.rank_of(stage - 1, replica) if stage > 0 else None
        nxt = self.rank_of(stage + 1, replica) if stage < self.num_stages - 1 else None
        return prev, nxt
