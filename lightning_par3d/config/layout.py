"""A run's resolved layout: the mesh sizes, the ZeRO stage and the pipeline schedule, and every fact derived
from them, computed once (:class:`Layout`; :func:`~lightning_par3d.config.validate.resolve_layout` makes one)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_par3d.config.schedules import stage_indices, stage_owner, stages_per_rank

DATA_PARALLEL_ENGINES = ("none", "ddp", "fsdp", "zero")
"""What serves the data-parallel dimension: nothing (dp = 1), torch DDP (pure replication without tp or pp),
FSDP2 (ZeRO-3, HSDP, or replication under tp or pp as one unit), or par3d's ZeRO-1/2 optimizer wrapper."""


@dataclass(frozen=True)
class Layout:
    """A run's resolved layout: the sizes of the four mesh dimensions, outermost first, the ZeRO stage, the pipeline
    schedule, and every fact derived from them, computed here once and read by every layer."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    zero_stage: int | None = None
    """None: the default, 3 when ``dp_shard > 1`` else 0 (see :attr:`zero`)."""
    schedule: str = "1f1b"
    """The pipeline schedule (used under pp > 1)."""
    virtual_stages: int = 1
    """Stages per pipeline rank as configured (the V schedules always hold 2: see :attr:`stages_per_rank`)."""
    microbatches: int = 4
    """Microbatches per batch under pp > 1."""
    reshard_after_forward_setting: bool | None = None
    """The configured ``reshard_after_forward``; :attr:`reshard_after_forward` resolves its default."""
    ep: int = 1
    """Expert-parallel degree: ranks of the mesh's ``dp_shard`` dimension (``dp_shard × cp``) that split the
    experts (no mesh dimension of its own)."""
    cp: int = 1
    """Context-parallel degree: ranks that split each sequence. They read the same rows, so they add ranks but not
    data-parallel ones; in the mesh they sit inside the ``dp_shard`` dimension (:attr:`shard_ranks`), which FSDP2
    shards over, as torchtitan shards over ``dp_shard × cp``."""

    @property
    def shard_ranks(self) -> int:
        """The mesh's ``dp_shard`` dimension: the ranks FSDP2 shards over, ``dp_shard × cp`` (``cp`` inner)."""
        return self.dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        """The ranks whose gradients and loss shares are summed: the data-parallel ranks times the context-parallel
        ones (each cp rank holds a slice of its rows' tokens)."""
        return self.dp * self.cp

    @property
    def expert_shard(self) -> int:
        """The ranks of the mesh's ``dp_shard`` dimension that hold the same experts, among which FSDP2 shards them:
        ``dp_shard × cp / ep``."""
        return self.shard_ranks // self.ep

    @property
    def zero(self) -> int:
        """The ZeRO stage over ``dp_shard``."""
        if self.zero_stage is not None:
            return self.zero_stage
        return 3 if self.shard_ranks > 1 else 0

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """The whole data-parallel size: ranks that read different rows (context-parallel peers read the same)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(pp, dp_replicate, dp_shard × cp, tp)``: the mesh's shape."""
        return (self.pp, self.dp_replicate, self.shard_ranks, self.tp)

    # ---------------------------------------------------------------- data parallel
    @property
    def data_parallel(self) -> str:
        """Which engine serves the data-parallel dimension: one of :data:`DATA_PARALLEL_ENGINES`."""
        if self.dp_cp == 1:
            return "none"
        if self.zero in (1, 2):
            return "zero"
        if self.shard_ranks == 1 and self.tp == 1 and self.pp == 1:
            return "ddp"
        return "fsdp"

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2's ``reshard_after_forward``: as configured, else True, except under pp, where parameters stay
        gathered across the microbatches of a step."""
        if self.reshard_after_forward_setting is not None:
            return self.reshard_after_forward_setting
        return self.pp == 1

    # ---------------------------------------------------------------- pipeline
    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.schedule, self.virtual_stages) if self.pp > 1 else 1

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all (1 without pipelining)."""
        return self.pp * self.stages_per_rank

    def stage_indices(self, pp_rank: int) -> list[int]:
        """The global stage indices pipeline rank ``pp_rank`` holds."""
        if self.pp == 1:
            return [0]
        return stage_indices(self.schedule, pp_rank, self.pp, self.virtual_stages)

    @property
    def last_stage_owner(self) -> int:
        """The pipeline rank that holds the last stage (where the loss and the outputs are)."""
        return stage_owner(self.schedule, self.n_stages - 1, self.pp) if self.pp > 1 else 0

    def __str__(self) -> str:
        cp = f" × cp={self.cp}" if self.cp > 1 else ""
        text = f"pp={self.pp} × dp_replicate={self.dp_replicate} × dp_shard={self.dp_shard}{cp} × tp={self.tp}"
        return text + (f" (ep={self.ep} within dp_shard)" if self.ep > 1 else "")
