"""A mixture-of-experts transformers model's load-balancing loss over the global batch, as one process computes it.

With ``output_router_logits=True`` a transformers MoE causal LM (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, …) adds
``router_aux_loss_coef · aux`` to its loss, where ``aux = E · Σ_e f_e · P_e`` over every layer's router: ``f_e`` the
share of routed (token, choice) pairs that went to expert ``e`` and ``P_e`` its mean router probability, both over
the batch's (unmasked) rows (Switch Transformer's loss, ``load_balancing_loss_func`` in the model's module). The loss
is a product of two batch means, not a mean of per-token terms: computed on each data-parallel rank's own rows and
averaged, it is not the global batch's (a tiny Qwen3-MoE at ``dp_shard=2``, coefficient 0.1: 1.5e-3 from one
process at the first step, 15× the parity bar).

``f_e`` has no gradient (a top-k count), so the global loss's gradient is ``E / R² · Σ_e c_e · ∇p_e`` with ``c_e``
and ``R`` (the routed pairs per expert and the rows, over the global batch) summed over the data-parallel ranks, and
``p_e`` each rank's own probability sums. Each rank's term is therefore ``dp · E · Σ_e c_e · p_e / R²``: the ranks'
terms average to the global loss, and so do their gradients under the data-parallel mean. The sums ``c_e`` and ``R``
are one all-reduce of ``E + 1`` numbers per step, over the data-parallel ranks (tensor-parallel ranks hold the same
tokens; context-parallel ranks hold slices of the same rows, each counted with its part of the caller's mask, so the
sums run over the ``dp × cp`` ranks).

The model calls its module's ``load_balancing_loss_func`` by name inside its ``forward``; par3d's version stands in
for it there, during that model's training forwards only (:func:`install`), and its local sums are checked once
against the model's own function on the same rows, so a model whose loss differs is refused rather than trained on
another loss.

**Accumulated batches.** With ``w`` batches per optimizer step the sums run over the whole window, but the first
batch's backward runs before the others are routed. At a window's first batch par3d therefore routes the others
ahead: each runs through the model's ``forward`` once without gradients (the window's batches are read ahead for the
token mean already, :class:`~lightning_par3d.engine.tokens.TokenWindows`), which records its counts and rows only;
the random state is kept, so training draws what it would have. The window's sums are then one all-reduce, and each
batch's term is ``w · dp · E · Σ_e c_e · p_e / R²`` (the token mean's share: the front-end's backward takes ``1/w``).
That costs one forward without gradients for each batch after a window's first. The model's inputs for a later batch
are found as the first batch's: each tensor the model got is matched to the tensor of the batch equal to it, and
the same places of the later batch are given. When each later batch trains, its own counts are checked against
what routing it ahead counted, on every rank alike: a model whose routing is random (dropout, router jitter) or
whose inputs are not the batch's tensors is refused rather than trained on another loss. Under pipelining the
stages never run the model's ``forward``, where the loss is added: :mod:`~lightning_par3d.engine.pipeline_router_loss`
adds it to the model's own ``labels=`` loss there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_par3d.distributed.gather import map_tensors
from lightning_par3d.utils.model_changes import set_attribute
from lightning_par3d.utils.patterns import find_transformers_model

_CALL_HOOK = "_par3d_router_call_hook"
"""The attribute holding the handle of the pre-hook that records the model's call as given."""
_ORIGINAL = "_par3d_model_forward"
"""The attribute of par3d's forward that holds the model's own (bound) one."""
OWN_FUNCTION = "load_balancing_loss_func"
"""The function a transformers MoE model's module defines and its ``forward`` calls by this name."""


def install(
    module: nn.Module,
    dp: int,
    dp_group: Callable[[], Any],
    accumulation: Callable[[], int],
    window: Callable[[], Any] = lambda: None,
    prepare: Callable[[Any], Any] = lambda batch: batch,
) -> bool:
    """Makes the load-balancing loss of the transformers MoE model in ``module`` (pp = 1) the global batch's (see
    the module docstring); whether there was one to make. ``dp_group()``: the data-parallel group (None for one
    rank); ``accumulation()``: the batches per optimizer step; ``window()``: the training batch's
    :class:`~lightning_par3d.engine.tokens.BatchTokens` (None without the token mean's read-ahead); ``prepare``: a
    batch as read → as the model gets it (on the device). Installing again (another engine) wraps the model's own
    ``forward``, not the earlier wrapper."""
    found = find_transformers_model(module)
    if found is None:
        return False
    model = found[1]
    home = sys.modules.get(type(model).__module__) if type(model).__module__ else None
    own = getattr(home, OWN_FUNCTION, None)
    if home is None or not callable(own):
        return False
    forward = getattr(model.forward, _ORIGINAL, model.forward)  # (not __wrapped__: transformers' decorators set it)
    state = _GlobalRouterLoss(own, dp, dp_group, accumulation, window, _mask_of_slice(model))
    previous = getattr(model, _CALL_HOOK, None)
    if previous is not None:
        previous.remove()
    set_attribute(model, _CALL_HOOK, model.register_forward_pre_hook(state.record_call, prepend=True, with_kwargs=True))

    def global_loss_forward(*args: Any, **kwargs: Any) -> Any:
        given, state.call = state.call, None  # the call as its caller made it: this forward's only, never kept after
        if not (model.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        with _standing_in(home, state):
            wanted = kwargs.get("output_router_logits")
            if wanted is None:
                wanted = getattr(getattr(model, "config", None), "output_router_logits", False)
            entry = window() if wanted and accumulation() > 1 else None
            if entry is not None and entry.index == 0:  # (the router's loss off: nothing to route ahead)
                state.route_ahead(forward, args, kwargs, entry, prepare, _context_of(model), given)
            return forward(*args, **kwargs)

    setattr(global_loss_forward, _ORIGINAL, forward)
    set_attribute(model, "forward", global_loss_forward)
    return True


def install_for(module: nn.Module, placement: Any, accumulation: Callable[[], int], token_mean: Any) -> bool:
    """:func:`install` with an engine's placement (its data-parallel ranks and device) and token mean (None when
    ``loss_mean`` is not ``"tokens"``: no window is read ahead)."""
    ranks = placement.layout.dp_cp  # the context-parallel ranks count their slices' tokens with the dp ranks
    dp_group = (lambda: placement.dp_group()) if ranks > 1 else (lambda: None)
    window = (lambda: token_mean.current) if token_mean is not None else (lambda: None)
    return install(
        module, ranks, dp_group, accumulation, window,
        lambda batch: map_tensors(lambda t: t.to(placement.device), batch),
    )  # fmt: skip


@contextmanager
def _standing_in(home: Any, state: _GlobalRouterLoss) -> Iterator[None]:
    saved = getattr(home, OWN_FUNCTION)
    setattr(home, OWN_FUNCTION, state)
    try:
        yield
    finally:
        setattr(home, OWN_FUNCTION, saved)


class _GlobalRouterLoss:
    """``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)`` of the global batch: this rank's
    term, ``w · dp · E · Σ_e c_e · p_e / R²`` (see the module docstring)."""

    def __init__(self, own: Callable[..., Any], dp: int, dp_group: Callable[[], Any], accumulation: Callable[[], int],
                 window: Callable[[], Any], mask_of_slice: Callable[[Any], Any] = lambda m: m) -> None:  # fmt: skip
        self.own, self.dp, self.dp_group, self.accumulation, self.window = own, dp, dp_group, accumulation, window
        self.mask_of_slice = mask_of_slice
        """The caller's ``attention_mask`` (whole rows) → that of the tokens this rank routed (a slice under cp)."""
        self.call: tuple[tuple, dict] | None = None
        """The model's call as its caller made it (:meth:`record_call`), from its hooks to its forward, which takes
        it (so no batch is held between calls)."""
        self.checked = False
        self.recording: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        """While routing ahead: each later batch's counts and rows, in order."""
        self.ahead: list[tuple[torch.Tensor, torch.Tensor]] = []
        """The window's later batches' counts and rows as routed ahead, checked as each trains."""
        self.totals: tuple[torch.Tensor, torch.Tensor] | None = None
        """The window's counts and rows, summed over its batches and the data-parallel ranks."""

    def record_call(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The model's call as its caller made it, before other hooks change it (context parallelism cuts its
        rows): what a later batch's call is made from."""
        self.call = (tuple(args), dict(kwargs))

    def route_ahead(self, forward: Callable[..., Any], args: tuple, kwargs: dict, entry: Any,
                    prepare: Callable[[Any], Any], context: Any = None,
                    given: tuple[tuple, dict] | None = None) -> None:  # fmt: skip
        """Runs the window's later batches (``entry.later``) through the model without gradients, recording their
        counts and rows (see the module docstring). A window of one batch (an epoch's last) has none. Under context
        parallelism (``context``) each later batch is made from the call as its caller made it (``given``: whole
        rows) and cut as the model's hook cuts it."""
        self.ahead = []
        if not entry.later:
            return
        if context is not None and given is not None:
            args, kwargs = given
        places = places_of(prepare(entry.batch), args, kwargs)
        self.recording = []
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                for batch in entry.later:
                    later_args, later_kwargs = call_for(places, prepare(batch), args, kwargs)
                    if context is None:
                        forward(*later_args, **later_kwargs)
                        continue
                    with context.another_call(later_args, later_kwargs) as (cut_args, cut_kwargs):
                        forward(*cut_args, **cut_kwargs)
            self.ahead = self.recording
        finally:
            self.recording = None

    def __call__(self, gate_logits: Any, num_experts: int | None = None, top_k: int = 2,
                 attention_mask: torch.Tensor | None = None) -> Any:  # fmt: skip
        if gate_logits is None or not isinstance(gate_logits, tuple) or num_experts is None:
            return self.own(gate_logits, num_experts, top_k, attention_mask)
        attention_mask = self.mask_of_slice(attention_mask)
        counts, probs, rows = routing_sums(gate_logits, num_experts, top_k, attention_mask)
        if self.recording is not None:  # a later batch routed ahead: its counts only
            self.recording.append((counts, rows.detach()))
            return probs.new_zeros(())
        w = self.accumulation()
        entry = self.window() if w > 1 else None
        if w > 1 and entry is None:
            raise ValueError(
                f"The model's router load-balancing loss (output_router_logits=True) is a product of two means over "
                f"the global batch, whose {w} accumulated batches par3d routes ahead from the dataloader it reads "
                "ahead for the token mean; this batch came from none (loss_mean='microbatches', or a loop par3d did "
                "not set up). Use loss_mean='tokens' (the default) with the front-end's dataloader, drop the "
                "accumulation, or set output_router_logits=False."
            )
        if entry is not None and entry.index > 0:
            window_counts, window_rows = self._checked_later(entry.index, counts, rows)
            batches = entry.batches
        else:
            window_counts, window_rows = self._summed(gate_logits, num_experts, top_k, attention_mask, counts, probs,
                                                      rows)  # fmt: skip
            batches = entry.batches if entry is not None else 1
        c, r = window_counts.to(probs.dtype), window_rows.to(probs.dtype)
        return batches * self.dp * num_experts * (c * probs).sum() / r**2

    def _summed(self, gate_logits: tuple, num_experts: int, top_k: int, attention_mask: Any, counts: torch.Tensor,
                probs: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The window's counts and rows (this batch's and those routed ahead), summed over the data-parallel ranks in
        one all-reduce, with (the first time) how many ranks found the model's own loss different."""
        differs = None
        if not self.checked:
            self.checked = True
            differs = self._differs(gate_logits, num_experts, top_k, attention_mask, counts, probs, rows)
        local_counts = counts + sum((c for c, _ in self.ahead), torch.zeros_like(counts))
        local_rows = rows.detach() + sum((r for _, r in self.ahead), torch.zeros_like(rows))
        summed = torch.cat([local_counts, local_rows.reshape(1), counts.new_tensor([float(differs is not None)])])
        summed = summed.to(torch.float64)
        group = self.dp_group()
        if group is not None:
            dist.all_reduce(summed, group=group)
        if summed[-1] > 0:
            raise differs_refusal(differs or "on another data-parallel rank", "train with one data-parallel rank")
        self.totals = (summed[:-2], summed[-2])
        return self.totals

    def _checked_later(self, index: int, counts: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The window's sums, after checking (with every data-parallel rank, so all raise alike) that this later
        batch routed as routing it ahead did."""
        expected = self.ahead[index - 1] if index - 1 < len(self.ahead) else None
        same = expected is not None and torch.equal(expected[0], counts) and torch.equal(expected[1], rows.detach())
        flag = torch.tensor([float(not same)], dtype=torch.float64, device=counts.device)
        group = self.dp_group()
        if group is not None:
            dist.all_reduce(flag, group=group)
        if flag.item() > 0 or self.totals is None:
            raise ValueError(
                f"The model's router load-balancing loss over the global batch: batch {index + 1} of the accumulation "
                "window routed its tokens otherwise than when par3d routed it ahead (on this or another "
                "data-parallel rank): the model's routing is random (dropout, router jitter noise) or it got inputs "
                "that are not the batch's tensors. Set those to 0, drop the accumulation, or set "
                "output_router_logits=False."
            )
        return self.totals

    def _differs(self, gate_logits: tuple, num_experts: int, top_k: int, attention_mask: Any, counts: torch.Tensor,
                 probs: torch.Tensor, rows: torch.Tensor) -> str | None:  # fmt: skip
        """How the model's own function's loss on these rows differs from the one these sums give (None: it does
        not; else its loss is not the one par3d makes global)."""
        with torch.no_grad():
            own = self.own(tuple(g.detach() for g in gate_logits), num_experts, top_k, attention_mask)
            mine = num_experts * (counts * probs.detach()).sum() / rows**2
        if torch.allclose(torch.as_tensor(own, dtype=mine.dtype), mine, rtol=1e-5, atol=1e-7):
            return None
        return f"{float(own):.6g} against {float(mine):.6g} on this rank's routing"


def _tensors_of(batch: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) batch, in order."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, batch)
    return found


def places_of(batch: Any, args: tuple, kwargs: dict) -> dict[str | int, int]:
    """Where each tensor argument of the model's call is in ``batch`` (the index, among the batch's tensors, of the one
    it is or equals); raises naming an argument that is none of the batch's tensors."""
    tensors = _tensors_of(batch)
    places: dict[str | int, int] = {}
    for key, value in [*enumerate(args), *kwargs.items()]:
        if not isinstance(value, torch.Tensor):
            continue
        found = next((i for i, t in enumerate(tensors) if t is value), None)
        if found is None:
            found = next(
                (i for i, t in enumerate(tensors) if t.shape == value.shape and t.dtype == value.dtype
                 and t.device == value.device and torch.equal(t, value)),
                None,
            )  # fmt: skip
        if found is None:
            raise ValueError(
                f"The model's router load-balancing loss over accumulated batches routes each window's later batches "
                f"ahead with the inputs the model got from the first, but its argument {key!r} is none of the "
                "batch's tensors (computed in training_step?). Pass the batch's tensors to the model, drop the "
                "accumulation, or set output_router_logits=False."
            )
        places[key] = found
    return places


def call_for(places: dict[str | int, int], batch: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The model's arguments for ``batch``: the first batch's call with each tensor replaced by ``batch``'s at its
    place (:func:`places_of`)."""
    tensors = _tensors_of(batch)
    new_args = tuple(tensors[places[i]] if i in places else a for i, a in enumerate(args))
    new_kwargs = {k: tensors[places[k]] if k in places else v for k, v in kwargs.items()}
    return new_args, new_kwargs


def _context_of(model: nn.Module) -> Any:
    """The context parallelism installed on ``model`` (its rows cut over cp ranks), or None."""
    from lightning_par3d.parallel.context_parallel import context_parallel_of

    return context_parallel_of(model)


def _mask_of_slice(model: nn.Module) -> Callable[[Any], Any]:
    """``attention_mask`` → that of the tokens this rank routed: under context parallelism the model got a slice of
    every row, and par3d kept the caller's mask of whole rows for the attention (the model's forward, which adds the
    router's loss, got none), so the slice's columns of it; the mask itself without cp."""

    def cut(mask: Any) -> Any:
        context = _context_of(model)
        current = context.current if context is not None else None
        if current is None:
            return mask
        whole = mask if isinstance(mask, torch.Tensor) and mask.shape[-1] == current.length else current.key_valid
        if whole is None:
            return mask
        return whole[..., current.positions.to(whole.device)].long()

    return cut


def routed(logits: torch.Tensor, mask: torch.Tensor | None, num_experts: int,
           top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One router call's (token, choice) pairs per expert, summed router probabilities per expert (with the gradient
    ``logits`` has) and rows, over the tokens ``mask`` (one float per token) weighs, every token if None; softmax and
    top-k as the model's own ``load_balancing_loss_func`` takes them."""
    weights = F.softmax(logits, dim=-1)
    chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
    ones = mask if mask is not None else torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=logits.device)
    counts = counts.index_add(0, chosen, ones.repeat_interleave(top_k))
    return counts, (weights.float() * ones.unsqueeze(-1)).sum(dim=0), ones.sum()


def routing_sums(gate_logits: tuple, num_experts: int, top_k: int,
          attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Over every layer's router logits and the unmasked rows: the (token, choice) pairs routed to each expert (no
    gradient), the sum of each expert's router probabilities, and the rows (:func:`routed`, summed)."""
    device = gate_logits[0].device
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    each = [routed(logits.to(device), mask, num_experts, top_k) for logits in gate_logits]
    counts, probs, rows = (torch.stack([layer[i] for layer in each]).sum(dim=0) for i in range(3))
    return counts.detach(), probs, rows


def differs_refusal(detail: str, fix: str) -> ValueError:
    """The error for a model whose own ``load_balancing_loss_func`` is not the loss par3d makes the global batch's."""
    return ValueError(
        f"The model's {OWN_FUNCTION} differs from the Switch Transformer loss par3d computes over the global batch "
        f"({detail}): par3d does not know how to make this model's load-balancing loss the global batch's. Set "
        f"output_router_logits=False, or {fix}."
    )
