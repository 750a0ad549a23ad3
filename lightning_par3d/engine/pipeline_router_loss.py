"""A mixture-of-experts transformers model's load-balancing loss under pipelining, as one process computes it.

With ``output_router_logits=True`` the model adds ``router_aux_loss_coef · aux`` to its own ``labels=`` loss, with
``aux = E · Σ_e c_e · P_e / R²`` over every layer's router and the batch's unmasked rows (``c_e``: the (token,
choice) pairs routed to expert ``e``, ``P_e``: its summed router probabilities, ``R``: the rows;
:mod:`lightning_par3d.engine.router_loss`, which makes it the global batch's for pp = 1). Under pipelining the
model's ``forward``, where that loss is added, never runs: each stage runs its own layers, microbatch by microbatch,
and a stage's backward begins before later microbatches are routed. So par3d computes it here, for the model's own
``labels=`` loss (a pipelined trunk called with ``labels=``, :func:`lightning_par3d.pipeline.trunk.attach_own_loss`):

1. **Routing ahead.** Before a window's first batch trains, each of its batches runs through the pipeline forward
   only, without gradients (the random state kept); hooks on the routers the model declares
   (``_can_record_outputs["router_logits"]``) sum each stage's counts, rows and probabilities, with the
   microbatch's ``attention_mask`` (which every stage gets). One all-reduce over the pipeline ranks gives each
   data-parallel rank's sums per batch, one over the data-parallel ranks the window's ``c`` and ``R``.
2. **The gradient.** ``c`` has none (a top-k count), so the global loss's gradient is ``E / R² · Σ_e c_e · ∇P_e``,
   which is a sum over the routers' calls: in the training schedule each router call adds
   ``coef · dp · E / R² · Σ_e c_e · p_e`` (its own probabilities ``p``) to its stage's output, as a term whose
   gradient is one and whose value is not added (:class:`_WithTermGradient`, Megatron's
   ``MoEAuxLossAutoScaler``): the data-parallel mean of the gradients is then one process's.
3. **The value.** The batch's loss gets ``coef · w · dp · E · Σ_e c_e · p_e / R²`` with ``p`` this data-parallel
   rank's probabilities over the batch, as the model's own loss gets it for pp = 1: averaged over the
   data-parallel ranks and the window's ``w`` batches it is one process's.
4. **Checked.** The first time, each stage's sums are checked against the model's own ``load_balancing_loss_func``
   on the same rows; after each batch trains, its counts against those routed ahead. A model whose loss differs,
   or whose routing is random (router jitter, dropout), is refused on every rank alike.

In evaluation (forward only) each data-parallel rank's ``aux`` is its own batch's, summed over the pipeline ranks:
the model's own for pp = 1. The cost: one forward without gradients of each training batch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par3d.engine.router_loss import OWN_FUNCTION, differs_refusal, routed, routing_sums
from lightning_par3d.parallel.context_parallel import positions_of
from lightning_par3d.utils.patterns import find_transformers_model
from lightning_par3d.utils.torch_private import in_backward, in_pipeline_metadata_inference

OFF, COUNT, TRAIN = "off", "count", "train"


def adds_router_loss(module: nn.Module) -> nn.Module | None:
    """The transformers model in ``module`` when it adds its router's load-balancing loss
    (``config.output_router_logits``), else None."""
    found = find_transformers_model(module)
    if found is None or not getattr(getattr(found[1], "config", None), "output_router_logits", False):
        return None
    return found[1]


def refusal(module: nn.Module, schedule: str) -> str | None:
    """Why the pipelined router loss cannot serve ``module``'s model at this layout (None: it can). V-shaped
    and zero-bubble schedules are refused: torch's forward-only run of a V (``schedule.eval``, which routing
    ahead needs) asks for backward state it does not have, and a backward split into input and weight passes
    fails on the routers' gradient terms."""
    from lightning_par3d.config.schedules import V_SCHEDULES

    split = schedule in V_SCHEDULES or "zero_bubble" in schedule
    model = adds_router_loss(module)
    if model is None:
        return None
    name = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.")), type(model)).__name__
    if _router_class(model) is None or not all(
        isinstance(getattr(model, a, None), (int, float)) for a in ("num_experts", "num_experts_per_tok")
    ):
        return (
            f"{name} adds a router load-balancing loss (output_router_logits=True) that par3d cannot find the "
            "routers of under pipelining (no _can_record_outputs['router_logits']): set output_router_logits=False, "
            "or train without pipelining (pp=1)."
        )
    if split:
        return (
            f"{name}'s router load-balancing loss (output_router_logits=True) under pipelining is not supported with "
            f"pipeline_schedule={schedule!r}, whose backward is split: set output_router_logits=False, choose "
            "another schedule (1f1b, interleaved_1f1b, gpipe, looped_bfs), or train without pipelining (pp=1)."
        )
    return None


def _router_class(model: nn.Module) -> tuple[type, int] | None:
    recorded = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorded, "target_class", None)
    return (target, int(getattr(recorded, "index", 0))) if isinstance(target, type) else None


class _WithTermGradient(torch.autograd.Function):
    """``output`` unchanged; in backward, ``term`` gets a gradient of one (its value is never added)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(term)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (term,) = ctx.saved_tensors
        return grad, torch.ones_like(term)


class PipelinedRouterLoss:
    """The router loss of one pipelined model (see the module docstring): hooks on this rank's stages and routers,
    and the window's sums. ``dp_group()``/``pp_group``: the groups the sums run over (``dp`` ranks);
    ``predict(call)``: one call's forward-only run through the pipeline."""

    def __init__(self, model: nn.Module, stages: Sequence[nn.Module], dp: int, dp_group: Callable[[], Any],
                 pp_group: Any, device: torch.device, context: Any = None) -> None:  # fmt: skip
        found = _router_class(model)
        assert found is not None
        router_class, self.index = found
        self.coef = float(getattr(model, "router_aux_loss_coef", 0.0))
        numbers: Any = model
        self.experts, self.top_k = int(numbers.num_experts), int(numbers.num_experts_per_tok)
        own_class = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.")), type(model))
        home = sys.modules.get(own_class.__module__)  # (the model's own class: par3d's pipelining swaps it)
        self.own = getattr(home, OWN_FUNCTION, None)
        self.dp, self.dp_group, self.pp_group, self.device = dp, dp_group, pp_group, device
        self.context = context
        """Under cp > 1 the model's :class:`~lightning_par3d.parallel.context_parallel.ContextParallel`: each rank
        routes its slice of every row (``dp`` then counts the data-parallel ranks times the cp ranks)."""
        self.mode = OFF
        self._mask: torch.Tensor | None = None
        self._skipping = False
        """The stage's call is torch's metadata inference (its first run of a schedule: inputs made from shapes)."""
        self._logits: list[torch.Tensor] = []
        """In training, the stage call's router logits so far (their gradient terms are taken at the stage's end)."""
        self._sums = self._zeros()
        self._checking: list[torch.Tensor] | None = None
        self._checked = False
        self._differs = 0.0
        self.window: _Window | None = None
        self._handles: list[Any] = []
        for stage in stages:
            routers = [m for m in stage.modules() if isinstance(m, router_class)]
            if not routers:
                continue
            # (first: under cp the stage's own pre-hook takes the whole rows' attention_mask out of the call)
            self._handles.append(stage.register_forward_pre_hook(self._stage_begins, with_kwargs=True, prepend=True))
            self._handles.append(stage.register_forward_hook(self._stage_ends))
            self._handles += [r.register_forward_hook(self._routed) for r in routers]

    def remove(self) -> None:
        """Removes the hooks (the model parallelized again, by another engine)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---------------------------------------------------------------- hooks
    def _zeros(self) -> torch.Tensor:
        """This rank's sums: counts (E), rows (1), probabilities (E)."""
        return torch.zeros(2 * self.experts + 1, dtype=torch.float64, device=self.device)

    def _stage_begins(self, _stage: nn.Module, args: tuple, kwargs: dict) -> None:
        self._mask, self._logits = kwargs.get("attention_mask"), []
        self._skipping = self.mode != OFF and in_pipeline_metadata_inference()
        if self.mode == COUNT and not self._checked and not self._skipping:
            self._checking = []

    def _routed(self, _router: nn.Module, _args: tuple, output: Any) -> None:
        if self.mode == OFF or self._skipping or in_backward():
            return  # (in a backward, activation checkpointing recomputes the router: counted once)
        logits = output[self.index] if isinstance(output, (tuple, list)) else output
        with torch.no_grad():  # (nothing saved for backward inside a checkpointed layer: its recompute saves nothing)
            counts, probs, rows = routed(logits, self._stage_mask(logits), self.experts, self.top_k)
            self._sums += torch.cat([counts, rows.reshape(1), probs]).to(self._sums)
        if self.mode == COUNT and self._checking is not None:
            self._checking.append(logits.detach())
        if self.mode == TRAIN and self.window is not None:
            self._logits.append(logits)

    def _stage_mask(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The stage call's ``attention_mask`` as one weight per routed token (None: every token counts)."""
        mask = self._rows_mask(logits.shape[0])
        return None if mask is None else mask.reshape(-1).to(device=logits.device, dtype=torch.float32)

    def _rows_mask(self, routed: int) -> torch.Tensor | None:
        """The stage call's ``attention_mask`` (whole rows) at the ``routed`` tokens this rank's routers see: the
        mask itself, or under context parallelism its columns at this rank's positions of each row."""
        mask, context = self._mask, self.context
        if mask is None or mask.numel() == routed:
            return mask
        if context is not None and mask.dim() == 2 and mask.numel() == routed * context.cp:
            return mask[:, positions_of(context.cp_rank, context.cp, mask.shape[1], mask.device)]
        raise ValueError(
            f"par3d's pipelined router loss: a router routed {routed} tokens, but the stage's attention_mask holds "
            f"{mask.numel()}; set output_router_logits=False, or train with pp=1."
        )

    def _stage_ends(self, _stage: nn.Module, _args: tuple, output: Any) -> Any:
        if self._checking is not None:
            self._check_own(self._checking)
            self._checking = None
        calls, self._logits = self._logits, []
        try:
            if self.mode != TRAIN or not calls or self._skipping or self.window is None:
                return None
            if not isinstance(output, torch.Tensor):
                raise TypeError("par3d's pipelined router loss needs each stage to return one tensor.")
            # the routers' terms, computed here, outside any checkpointed layer: Σ_e c_e · p_e of each router call
            counts = self.window.counts.to(torch.float32)
            terms = [(routed(x, self._stage_mask(x), self.experts, self.top_k)[1] * counts).sum() for x in calls]
            return _WithTermGradient.apply(output, torch.stack(terms).sum() * self.window.scale)
        finally:
            self._mask = None

    def _check_own(self, gate_logits: list[torch.Tensor]) -> None:
        """Whether the model's own loss on this stage's routers of this microbatch is the one these sums give."""
        self._checked = True
        if not callable(self.own) or not gate_logits:
            return
        mask = self._rows_mask(gate_logits[0].shape[0])
        with torch.no_grad():
            own = self.own(tuple(gate_logits), self.experts, self.top_k, mask)
            counts, probs, rows = (x.double() for x in routing_sums(tuple(gate_logits), self.experts, self.top_k, mask))
            mine = self.experts * (counts * probs).sum() / rows**2
        if not torch.allclose(torch.as_tensor(own, dtype=mine.dtype), mine, rtol=1e-5, atol=1e-7):
            self._differs = 1.0

    # ---------------------------------------------------------------- a window
    def route_ahead(self, calls: Sequence[Any], predict: Callable[[Any], Any]) -> None:
        """Routes a window's batches (``calls``, the first the one about to train) forward only, and sums their
        counts, rows and probabilities (see the module docstring). Every pipeline and data-parallel rank calls it."""
        local = []
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        self.mode = COUNT
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                for call in calls:
                    self._sums = self._zeros()
                    predict(call)
                    local.append(self._sums)
        finally:
            self.mode = OFF
        stacked = torch.stack(local)
        mine = torch.cat([stacked.reshape(-1), torch.tensor([self._differs], dtype=torch.float64,
                                                            device=self.device)])  # fmt: skip
        dist.all_reduce(mine, group=self.pp_group)  # this data-parallel rank's sums, over its pipeline stages
        chain = mine[:-1].reshape(stacked.shape)
        counted = torch.cat([chain[:, : self.experts + 1].sum(dim=0), mine[-1:]])
        group = self.dp_group()
        if group is not None:
            dist.all_reduce(counted, group=group)
        if counted[-1] > 0:
            raise differs_refusal("under pipelining, on a stage's routers", "train without pipelining (pp=1)")
        counts, rows = counted[: self.experts], counted[self.experts]
        scale = self.coef * self.dp * self.experts / float(rows) ** 2
        self.window = _Window(counts, float(rows), scale, [c[self.experts + 1 :] for c in chain], local)

    def trained(self, run: Callable[[], torch.Tensor], index: int, batches: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the window's batch ``index`` of ``batches`` (``run()``: its training schedule, returning its loss)
        with the routers' gradient terms; returns its loss with ``coef · aux`` added, and that ``aux``. Checks its
        routing against what was routed ahead, with every rank."""
        window = self.window
        assert window is not None, "route_ahead first"
        self._sums, self.mode = self._zeros(), TRAIN
        try:
            loss = run()
        finally:
            self.mode = OFF
        expected = window.local[index] if index < len(window.local) else None
        same = expected is not None and torch.equal(expected[: self.experts + 1], self._sums[: self.experts + 1])
        flag = torch.tensor([float(not same)], dtype=torch.float64, device=self.device)
        dist.all_reduce(flag)
        if flag.item() > 0:
            raise ValueError(
                f"The model's router load-balancing loss under pipelining: batch {index + 1} of the step routed its "
                "tokens otherwise in training than when par3d routed it ahead (on this or another rank): the model's "
                "routing is random (dropout, router jitter noise) or its inputs changed. Set those to 0, or set "
                "output_router_logits=False."
            )
        probs = window.probs[index].to(torch.float64)
        aux = batches * self.dp * self.experts * (window.counts * probs).sum() / window.rows**2
        return loss + (self.coef * aux).to(loss), aux.to(loss)

    def evaluated(self, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward-only run (``run()``, returning the batch's loss) with this data-parallel rank's own ``aux``
        added, as the model adds it for pp = 1; returns the loss and that ``aux``."""
        self._sums, self.mode = self._zeros(), COUNT
        try:
            loss = run()
        finally:
            self.mode = OFF
        sums = self._sums.clone()
        dist.all_reduce(sums, group=self.pp_group)
        if self.context is not None:  # the data-parallel rank's whole rows: the slices of its cp ranks
            dist.all_reduce(sums, group=self.context.group)
        counts, rows, probs = sums[: self.experts], sums[self.experts], sums[self.experts + 1 :]
        aux = self.experts * (counts * probs).sum() / rows.clamp(min=1) ** 2
        return loss + (self.coef * aux).to(loss), aux.to(loss)


@dataclass
class _Window:
    """A window's sums: its counts and rows over every rank, the gradient terms' scale, this data-parallel rank's
    probabilities per batch (over its pipeline stages), and this rank's own sums per batch (for the check)."""

    counts: torch.Tensor
    rows: float
    scale: float
    probs: list[torch.Tensor]
    local: list[torch.Tensor]
