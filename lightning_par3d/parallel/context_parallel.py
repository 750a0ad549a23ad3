"""Context parallelism: each sequence split over the ``cp`` ranks, attention computed as one process computes it.

**The split.** A row of ``T`` tokens is cut into ``2·cp`` chunks; context-parallel rank ``r`` holds chunks ``r`` and
``2·cp − 1 − r`` (:func:`positions_of`), so that under the causal mask every rank holds as many early (cheap) as
late (costly) queries: torch's, torchtitan's and Megatron's load balancing. ``T`` must divide by ``2·cp``.

**Where the sequence is cut.** The *trunk* (the transformers model inside the module, else the module's
``pipeline_trunk``, else the model itself) gets a forward pre-hook (:class:`ContextParallel`) that, on every call,
takes the whole rows it is given and passes on this rank's tokens only:

* the token ids (the first positional argument or ``input_ids``), at this rank's positions;
* ``position_ids``: the tokens' *global* positions (the caller's own, cut the same way, or ``0 … T−1``), so that
  rotary tables and position embeddings are those of one process; the trunk's ``forward`` must take ``position_ids``;
* ``labels`` (a transformers model's own loss): shifted by one over the *whole* row first (the last position gets
  ``ignore_index``), then cut, and passed as ``shift_labels``, so no token's target is lost at a slice's edge;
* ``attention_mask`` (``(batch, T)``, 1 for real tokens) is kept whole for the attention below and not passed on;
  ``position_ids`` restarting within a row without a mask mark packed documents where transformers reads them so
  (a transformers model run without a key/value cache: ``use_cache=False``); otherwise one process attends causally
  across them, and so does par3d.

The trunk's outputs are this rank's positions only. The module's declared loss (``pipeline_loss``) gets its targets
cut to the same positions (:meth:`ContextParallel.cut_targets`): the token mean then counts each rank's slice and
sums the slices over the ``dp × cp`` ranks (:mod:`lightning_par3d.engine.tokens`).

**Attention.** Each block of the trunk runs under a ``TorchFunctionMode`` (:class:`_GatheredAttention`, entered by
the block's own forward through a mixed-in class, so that it is there again when activation checkpointing
recomputes the block in backward) that takes torch's ``scaled_dot_product_attention``: the keys and values are
all-gathered over the cp ranks (torch's functional collective with autograd, whose backward reduce-scatters their
gradients: torch's "all-gather" rotation, as in Llama 3's context parallelism), and the call runs on the whole
sequence's keys with an explicit mask built from the global positions: causal, without padded keys, and within a
packed document. It works on every device torch's attention does (CPU over gloo included). A
``scaled_dot_product_attention`` call outside a block, and a block that attends otherwise (transformers' ``eager``
attention), are refused rather than computed on a slice.

Keys and values a transformers model repeated for its query heads (``repeat_kv``) are gathered once per key/value
head and attended with ``enable_gqa``: the model repeats them on some ranks and not others (its own mask code reads
a rank's two chunks as packed), and every rank must gather the same shapes.

Masks par3d cannot honour are refused by name: sliding-window layers and a transformers attention other than
``sdpa`` when the model is parallelized (:func:`check_model`), a mask of another shape than ``(batch, sequence)``
at its first call.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_par3d.utils.model_changes import set_attribute, swap_class
from lightning_par3d.utils.patterns import find_transformers_model, is_transformers_model
from lightning_par3d.utils.torch_private import in_backward

SDPA = F.scaled_dot_product_attention
_MARK = "_par3d_context_parallel"


def positions_of(cp_rank: int, cp: int, length: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions context-parallel rank ``cp_rank`` holds of a row of ``length`` tokens: chunks
    ``cp_rank`` and ``2·cp − 1 − cp_rank`` of ``2·cp``, in order (int64, ``length / cp`` of them)."""
    check_length(length, cp)
    chunk = length // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def check_length(length: int, cp: int) -> None:
    """Raises ``ValueError`` naming the fix when a row of ``length`` tokens cannot be split over ``cp`` ranks."""
    if length % (2 * cp):
        raise ValueError(
            f"cp={cp} splits each row into 2 × cp = {2 * cp} equal chunks (two per rank, one early and one late, so "
            f"that the causal mask gives each rank the same work), but the rows hold {length} tokens. Make the "
            f"sequence length a multiple of {2 * cp} (pad the rows, or set the block size), or choose another cp."
        )


@dataclass
class SequenceSlice:
    """One trunk call's rows as this rank holds them: their length, this rank's positions, the positions of the keys
    the attention gathers (every cp rank's, in rank order), and what masks them."""

    length: int
    positions: torch.Tensor
    keys: torch.Tensor
    key_valid: torch.Tensor | None = None
    """``(batch, length)`` bool: real tokens (the caller's ``attention_mask``), or None (all real)."""
    documents: torch.Tensor | None = None
    """``(batch, length)``: each token's document in a packed row, or None (one document a row)."""
    attended: int = 0
    """The attention calls taken during this call."""
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def mask(self) -> torch.Tensor:
        """The attention mask of this rank's queries against the gathered keys, ``(batch or 1, 1, queries, keys)``
        bool (True: attend): causal by global position, without padded keys, within a document. Built once."""
        if self._mask is None:
            q, k = self.positions, self.keys
            mask = (k[None, :] <= q[:, None])[None]  # (1, Tq, Tk)
            if self.key_valid is not None:
                mask = mask & self.key_valid[:, k][:, None, :]
            if self.documents is not None:
                mask = mask & (self.documents[:, q][:, :, None] == self.documents[:, k][:, None, :])
            self._mask = mask[:, None]
        return self._mask


class _GatheredAttention(TorchFunctionMode):
    """Takes ``scaled_dot_product_attention`` inside a block of the trunk: the keys and values of every cp rank,
    gathered with autograd, masked by :meth:`SequenceSlice.mask`. Every other call goes through unchanged."""

    def __init__(self, owner: ContextParallel) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not SDPA:
            return func(*args, **kwargs)
        return self.owner.attend(*args, **kwargs)


class _AttendingBlock(nn.Module):
    """Mixed into a block's class (before activation checkpointing mixes in its own, so that the recomputation in
    backward runs this forward again): the block's forward runs under :meth:`ContextParallel.block`."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with getattr(self, _MARK).block(args[0] if args else None):
            return super().forward(*args, **kwargs)


class _OutsideBlocks(TorchFunctionMode):
    """Refuses ``scaled_dot_product_attention`` in the trunk outside its blocks (it would see a slice only)."""

    def __init__(self, owner: ContextParallel) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is SDPA and not self.owner.in_block:
            raise RuntimeError(
                "cp > 1: the model called scaled_dot_product_attention outside its repeated blocks, where par3d "
                "does not gather the whole sequence's keys. Keep attention inside the blocks (the members of the "
                "model's ModuleList), or set fsdp_blocks= to the modules that hold it."
            )
        return func(*args, **(kwargs or {}))


class ContextParallel:
    """Context parallelism installed on one model: the trunk's pre-hook that cuts each call's rows, the blocks'
    attention, the loss's targets. ``group``: the cp process group; ``ignore_index``: the target of the last
    position once labels are shifted."""

    def __init__(self, trunk: nn.Module, blocks: list[nn.Module], group: Any, cp_rank: int, cp: int,
                 ignore_index: int) -> None:  # fmt: skip
        self.trunk, self.blocks, self.group = trunk, blocks, group
        self.cp_rank, self.cp, self.ignore_index = cp_rank, cp, ignore_index
        self.current: SequenceSlice | None = None
        self._modes: list[TorchFunctionMode] = []
        self.in_block = 0
        """Blocks being run (their attention is taken; the gathered call itself passes the trunk's check)."""
        self._attending: list[SequenceSlice | None] = []
        """The rows' slice of each block being run, innermost last."""
        self._rows_of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Each block input's slice, for its recomputation (held while the input lives)."""
        self._handles: list[Any] = []
        self.kv_ratio = kv_ratio_of(trunk)
        """Query heads per key/value head of a transformers model (grouped-query attention), else 1."""
        takes = inspect.signature(trunk.forward).parameters
        self._kwargs_ok = any(p.kind is p.VAR_KEYWORD for p in takes.values())
        self._takes = set(takes)

    # ---------------------------------------------------------------- hooks
    def install(self) -> None:
        self._handles.append(self.trunk.register_forward_pre_hook(self._cut, with_kwargs=True))
        self._handles.append(self.trunk.register_forward_hook(self._trunk_done, always_call=True))
        for block in self.blocks:
            swap_class(block, _AttendingBlock, "ContextParallel")
            set_attribute(block, _MARK, self)
        setattr(self.trunk, _MARK, self)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if getattr(self.trunk, _MARK, None) is self:
            delattr(self.trunk, _MARK)

    @contextmanager
    def block(self, hidden: Any = None) -> Iterator[None]:
        """A block's forward (or its recomputation in backward): its attention takes the whole sequence's keys, masked
        by the slice of the rows its input ``hidden`` belongs to. Activation checkpointing recomputes the block with
        the same input object, maybe after the forwards of other rows (a pipeline's later microbatches): the slice
        is found again by that object."""
        rows = self.current
        if isinstance(hidden, torch.Tensor):  # a forward records its input's rows; a recomputation (in backward) reads
            if in_backward():  # them back (a forward-only schedule passes each microbatch in the same buffer object)
                rows = self._rows_of.get(hidden, rows)
            else:
                self._rows_of[hidden] = rows
        self.in_block += 1
        self._attending.append(rows)
        try:
            with _GatheredAttention(self):
                yield
        finally:
            self._attending.pop()
            self.in_block -= 1

    def _trunk_done(self, module: nn.Module, args: Any, output: Any) -> None:
        outside = self._modes.pop()
        outside.__exit__(None, None, None)
        current = self.current
        if current is not None and current.attended == 0 and sys.exc_info()[1] is None:
            raise RuntimeError(
                "cp > 1: the model's blocks ran without calling torch's scaled_dot_product_attention, so par3d could "
                "not give them the whole sequence's keys. A transformers model must use attn_implementation='sdpa'; "
                "another model must compute attention with torch.nn.functional.scaled_dot_product_attention."
            )

    # ---------------------------------------------------------------- the rows
    def _cut(self, module: nn.Module, given_args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        args, kwargs = list(given_args), dict(kwargs)
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("cp > 1 cuts the token ids (input_ids); inputs_embeds is not supported. Pass input_ids.")
        ids = args[0] if args else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(
                f"cp > 1 cuts the model's token ids, (batch, sequence), the first argument or input_ids; got "
                f"{type(ids).__name__ if not isinstance(ids, torch.Tensor) else tuple(ids.shape)}."
            )
        batch, length = ids.shape
        mask = kwargs.pop("attention_mask", None)
        given = kwargs.get("position_ids")
        self.current = self.slice_rows(batch, length, ids.device, mask, given, kwargs)
        positions = self.current.positions
        local = ids[:, positions]
        if args:
            args[0] = local
        else:
            kwargs["input_ids"] = local
        self._pass(kwargs, "position_ids", given[..., positions] if given is not None else positions[None])
        labels = kwargs.get("labels")
        if labels is not None and (not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (batch, length)):
            raise ValueError(
                f"cp > 1 shifts a causal LM's labels, one per token, (batch, sequence) = {(batch, length)}, before "
                f"cutting them; got labels of shape {tuple(getattr(labels, 'shape', ()))}. Pass per-token labels, or "
                "compute the loss from the outputs through the module's declared pipeline_loss."
            )
        if labels is not None:
            shifted = torch.full_like(labels, self.ignore_index)
            shifted[:, :-1] = labels[:, 1:]
            kwargs["labels"] = shifted[:, positions]
            kwargs["shift_labels"] = shifted[:, positions]
        self._refuse_other_sequences(kwargs, batch, length)
        self._enter_trunk()
        return tuple(args), kwargs

    @contextmanager
    def another_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[tuple[Any, ...], Any]]:
        """A call of the trunk's ``forward`` made directly, on whole rows, inside another (a batch routed ahead of
        the one in progress, :mod:`lightning_par3d.engine.router_loss`): yields its arguments cut as the trunk's
        hook cuts them, and gives the call in progress its slice back after."""
        saved = self.current
        cut = self._cut(self.trunk, args, kwargs)
        try:
            yield cut
        finally:
            self._modes.pop().__exit__(None, None, None)
            self.current = saved

    def _enter_trunk(self) -> None:
        """The trunk's forward begins: attention outside its blocks is refused until it ends (:meth:`_trunk_done`)."""
        outside = _OutsideBlocks(self)
        outside.__enter__()
        self._modes.append(outside)

    def slice_rows(self, batch: int, length: int, device: torch.device, mask: torch.Tensor | None,
                   given: torch.Tensor | None, kwargs: dict[str, Any]) -> SequenceSlice:  # fmt: skip
        """This rank's :class:`SequenceSlice` of ``batch`` rows of ``length`` tokens, with the caller's whole-row
        ``attention_mask`` and ``position_ids`` (None: not given)."""
        check_length(length, self.cp)
        positions = positions_of(self.cp_rank, self.cp, length, device)
        keys = torch.cat([positions_of(r, self.cp, length, device) for r in range(self.cp)])
        if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (batch, length)):
            raise ValueError(
                f"cp > 1 honours a (batch, sequence) attention_mask of 1s (real tokens) and 0s (padding); got one of "
                f"shape {tuple(mask.shape)}. A mask of the model's own shape cannot be split over the cp ranks."
            )
        documents = None
        if given is not None and mask is None and self._reads_documents(kwargs):
            # packed rows: a document begins where the positions do not go on (transformers' own rule)
            first = given[..., :1] - 1
            documents = (torch.diff(given, prepend=first, dim=-1) != 1).cumsum(-1).expand(batch, length)
        key_valid = mask.bool() if mask is not None and not bool(mask.bool().all()) else None
        return SequenceSlice(length, positions, keys, key_valid, documents)

    def _reads_documents(self, kwargs: dict[str, Any]) -> bool:
        """Whether the model masks packed documents apart, as transformers does for ``position_ids`` without an
        ``attention_mask`` when it runs without a key/value cache (``use_cache`` False, given or configured); a
        model of another kind attends causally across them."""
        if not is_transformers_model(self.trunk):
            return False
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.trunk.config, "use_cache", False)
        return not use_cache and kwargs.get("past_key_values") is None

    def _pass(self, kwargs: dict[str, Any], name: str, value: Any) -> None:
        if name not in self._takes and not self._kwargs_ok:
            raise TypeError(
                f"cp > 1 gives {type(self.trunk).__name__} the global position of each token it holds through a "
                f"{name}= argument, which its forward does not take. Add `{name}=None` to its forward and use it "
                "for the positions (e.g. the position embedding or the rotary table)."
            )
        kwargs[name] = value

    def _refuse_other_sequences(self, kwargs: dict[str, Any], batch: int, length: int) -> None:
        known = {"input_ids", "position_ids", "labels", "shift_labels"}
        for name, value in kwargs.items():
            if name not in known and isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
                raise ValueError(
                    f"cp > 1: the model was given {name}= of shape {tuple(value.shape)}, a tensor along the sequence "
                    "that par3d does not know how to split over the cp ranks. Pass input_ids, attention_mask, "
                    "position_ids and labels only."
                )

    # ---------------------------------------------------------------- attention
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:  # fmt: skip
        """``scaled_dot_product_attention`` of this rank's queries against every rank's keys and values."""
        from lightning_par3d.utils.torch_private import all_gather_with_autograd

        current = self._attending[-1] if self._attending else self.current
        if current is None:
            raise RuntimeError("cp > 1: attention ran before the model's trunk cut its rows.")
        current.attended += 1
        # keys and values a transformers model repeated for its query heads (repeat_kv: each key/value head n times
        # in a row), which it does on some ranks and not others (its mask of a slice may differ): each head gathered
        # once, attended with enable_gqa, so every rank gathers the same shapes
        key, value = unrepeated(query, key, value, self.kv_ratio)
        enable_gqa = enable_gqa or key.shape[-3] != query.shape[-3]
        seq = key.dim() - 2
        keys = all_gather_with_autograd(key.contiguous(), seq, self.group)
        values = all_gather_with_autograd(value.contiguous(), seq, self.group)
        return SDPA(query, keys, values, attn_mask=current.mask(), dropout_p=dropout_p, is_causal=False, scale=scale,
                    enable_gqa=enable_gqa)  # fmt: skip

    # ---------------------------------------------------------------- targets
    def cut_targets(self, outputs: Any, targets: Any) -> Any:
        """``targets`` at this rank's positions when they span the whole rows of the last call and ``outputs`` this
        rank's (the loss of the module's declared ``pipeline_loss``); as they are otherwise."""
        current = self.current
        if current is None or not isinstance(targets, torch.Tensor) or targets.dim() < 2:
            return targets
        logits = getattr(outputs, "logits", outputs)
        local = len(current.positions)
        if targets.shape[1] == current.length and isinstance(logits, torch.Tensor) and logits.shape[1] == local:
            return targets[:, current.positions.to(targets.device)]
        return targets

    def cut_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``loss_fn(outputs, targets, ...)`` with the targets cut (:meth:`cut_targets`)."""

        def cut(outputs: Any, targets: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            return loss_fn(outputs, self.cut_targets(outputs, targets), *args, **kwargs)

        cut.__wrapped__ = loss_fn  # type: ignore[attr-defined]
        cut._par3d_loss_wrapper = True  # type: ignore[attr-defined]
        cut._cut_by = self  # type: ignore[attr-defined]
        return cut

    def cut_counted(self, targets: torch.Tensor, shifted: bool) -> torch.Tensor:
        """The targets a training batch's loss counts (read ahead for the token mean) at this rank's positions:
        ``shifted`` targets (a transformers model's own loss, ``labels[..., 1:]``) get the last position's
        ``ignore_index`` back first, as :meth:`_cut` shifts them."""
        if shifted:
            pad = torch.full_like(targets[..., :1], self.ignore_index)
            targets = torch.cat([targets, pad], dim=-1)
        return targets[..., positions_of(self.cp_rank, self.cp, targets.shape[-1], targets.device)]


def kv_ratio_of(trunk: nn.Module) -> int:
    """Query heads per key/value head of a transformers model (grouped-query attention), else 1."""
    config = getattr(trunk, "config", None)
    heads, kv_heads = getattr(config, "num_attention_heads", 1), getattr(config, "num_key_value_heads", None)
    return heads // kv_heads if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads else 1


def unrepeated(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_ratio: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``key`` and ``value`` with each key/value head once, where the model repeated them ``kv_ratio`` times for its
    query heads (``repeat_kv``); as given otherwise. What the cp ranks gather."""
    if kv_ratio == 1 or key.shape[-3] != query.shape[-3]:
        return key, value

    def once(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-3, (t.shape[-3] // kv_ratio, kv_ratio))[..., 0, :, :]

    return once(key), once(value)


def context_problem(module: nn.Module) -> str | None:
    """Why cp > 1 cannot split ``module`` (a built model: its trunk, attention and positions), in the words of the
    refusal a run would raise; None where it can. The planner asks before it searches context-parallel layouts."""
    try:
        trunk = find_trunk(module)
        check_model(trunk)
    except (TypeError, ValueError) as error:
        return str(error)
    takes = inspect.signature(trunk.forward).parameters
    if "position_ids" not in takes and not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        return (
            f"cp > 1 gives {type(trunk).__name__} the global position of each token it holds through a position_ids= "
            "argument, which its forward does not take."
        )
    return None


def find_trunk(module: nn.Module) -> nn.Module:
    """The module whose calls take the token ids: the transformers model inside ``module``, else its
    ``pipeline_trunk``, else ``module`` itself (a plain model)."""
    found = find_transformers_model(module)
    if found is not None:
        return found[1]
    name = getattr(module, "pipeline_trunk", None)
    if name is None:
        return module
    trunk = getattr(module, name, None) if isinstance(name, str) else None
    if not isinstance(trunk, nn.Module):
        raise TypeError(
            f"cp > 1 cuts the token ids where the model takes them: {type(module).__name__}.pipeline_trunk={name!r} "
            "names no module of it. Name the attribute that holds the model (see lightning_par3d.pipeline.trunk)."
        )
    return trunk


def check_model(trunk: nn.Module) -> None:
    """Refuses a transformers model whose attention par3d cannot compute under cp as one process does, naming why."""
    if not is_transformers_model(trunk):
        return
    config = trunk.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in (None, "sdpa"):
        raise ValueError(
            f"cp > 1 computes attention through torch's scaled_dot_product_attention, but {type(trunk).__name__} uses "
            f"attn_implementation={implementation!r}. Build the model with attn_implementation='sdpa' (the default "
            "on torch ≥ 2.1); 'eager', flash and flex attention are not split over cp ranks."
        )
    layer_types = getattr(config, "layer_types", None) or []
    windowed = [t for t in layer_types if "sliding" in str(t) or "chunked" in str(t)]
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", True)
    if windowed or (window is not None and uses_window and not layer_types):
        raise ValueError(
            f"cp > 1 masks attention causally by global position, but {type(trunk).__name__}'s config has sliding-"
            f"window attention (sliding_window={window}, layer types {sorted(set(map(str, layer_types))) or 'none'}), "
            "which par3d does not split over cp ranks and will not replace with full attention. Set "
            "sliding_window=None (or use_sliding_window=False) if the model is meant to attend fully, or use cp=1."
        )


def context_parallel_of(module: nn.Module) -> ContextParallel | None:
    """The :class:`ContextParallel` installed on ``module``'s trunk, if any."""
    for sub in module.modules():
        found = getattr(sub, _MARK, None)
        if isinstance(found, ContextParallel):
            return found
    return None


def apply_context_parallel(module: nn.Module, blocks: list[nn.Module], group: Any, cp_rank: int, cp: int,
                           ignore_index: int) -> ContextParallel:  # fmt: skip
    """Installs context parallelism on ``module`` (see the module docstring); ``blocks`` are the trunk's repeated
    blocks, where attention runs."""
    trunk = find_trunk(module)
    check_model(trunk)
    inside = [b for b in blocks if any(b is m for m in trunk.modules())]
    if not inside:
        raise ValueError(
            f"cp > 1 gathers the keys where the model's blocks attend, but no repeated block was found inside "
            f"{type(trunk).__name__}. Set fsdp_blocks= to the pattern of its blocks (e.g. 'model.layers.*')."
        )
    installed = context_parallel_of(module)
    if installed is not None:
        installed.remove()
    cp_state = ContextParallel(trunk, inside, group, cp_rank, cp, ignore_index)
    cp_state.install()
    return cp_state


def cut_declared_loss(module: nn.Module, token_mean: Any) -> ContextParallel:
    """Under cp > 1, once the model is parallelized: the module's declared loss (``pipeline_loss``) takes its targets
    at this rank's positions (outside the token mean's share, which then counts them), and the token mean counts
    the batches it reads ahead the same way. Returns the model's :class:`ContextParallel`."""
    context = context_parallel_of(module)
    if context is None:
        raise RuntimeError("cp > 1, but the model was not parallelized with context parallelism.")
    name = getattr(module, "pipeline_loss", None)
    if isinstance(name, str) and callable(getattr(module, name, None)):
        loss = getattr(module, name)
        while getattr(loss, "_cut_by", None) is not None:  # parallelized again: cut the loss once
            loss = loss.__wrapped__
        set_attribute(module, name, context.cut_loss(loss))
    if token_mean is not None:
        token_mean.cut = context.cut_counted
    return context
