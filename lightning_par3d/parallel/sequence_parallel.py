"""``sequence_parallel=True``: the sequence-parallel version of a model's tensor-parallel plan, derived from it.

A tensor-parallel plan splits the weights of attention and MLP; between them, everything a block does on the
residual stream (its norms, dropouts and residual additions) runs on every token on every tp rank, and those
activations are whole on each. Megatron's sequence parallelism splits that stream along the sequence instead, so
those activations take ``1 / tp`` of the memory, and replaces each all-reduce by a reduce-scatter and an
all-gather of the same total volume. transformers' own plans have no sequence-parallel entries, so par3d writes
them from the plain plan (the user's, or the model's own with ``tp_plan="auto"``), the way torchtitan writes
Llama's by hand:

* the first repeated block (a transformer layer) takes its input's sequence shard (``sequence_shard``: the
  embeddings before it stay whole);
* inside each block, a ``rowwise`` projection reduce-scatters into sequence shards (``rowwise_seq``); the parent of
  ``colwise`` projections (the attention, the MLP) gathers the sequence once for all of them (``gather_sequence``;
  a ``colwise`` projection directly in the block gathers its own input, ``colwise_seq``); each norm on the residual
  stream runs on the shards, its weights' gradients summed over tp (``sequence_parallel``);
* a mixture-of-experts block (the parent of ``moe_tp_experts``) runs on the whole sequence (``whole_sequence``:
  gathered on entry, its whole output cut back to this rank's shard on exit), its router, experts and shared expert
  planned as the plain plan writes them: every tp rank routes the same tokens, with or without ``ep``. (Its exit
  takes the shard of an all-reduced output, where a reduce-scatter would move half the bytes: the plain plan's
  experts sum their partial outputs themselves.)
* after the last block, a norm does the same, and the LM head gathers the sequence (``colwise_gather_output`` →
  ``colwise_seq_gather_output``, ``colwise`` → ``colwise_seq``).

Every module this cannot place is refused with its name before anything is built: a style with no
sequence-parallel counterpart inside a block, a parameter on the residual stream outside the plan (its gradient
would be one rank's tokens' only), a module after the blocks that would read sharded hidden states unplanned. A
plan that already has sequence-parallel entries is used as written only with ``sequence_parallel=False``.

The sequence length must divide by tp (checked at the first step, with the fix). Under pipelining, the stages
exchange the sequence shards (``T / tp`` tokens a rank), and a transformers stage computes its positions and masks
for the whole sequence (:mod:`lightning_par3d.pipeline.transformers_stages`).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_par3d.config.tp_vocabulary import SEQUENCE_STYLES, canonical
from lightning_par3d.utils.patterns import repeated_members

IN_BLOCK_KEPT = ("replicated_with_grad_allreduce", "local_params", "replicate")
"""Styles a block may hold inside a gathered region, kept as they are (they see the whole sequence there)."""
WHOLE_OWNERS = ("moe_tp_experts",)
"""Styles whose parent runs on the whole sequence (``whole_sequence``): a mixture-of-experts block, whose router
and tp-split experts must see the same tokens on every tp rank."""
HEAD_STYLES = {"colwise_gather_output": "colwise_seq_gather_output", "colwise": "colwise_seq"}
"""After the last block: the plain style → the one that gathers the sequence first."""


def is_norm(module: nn.Module) -> bool:
    """A normalization layer (torch's ``LayerNorm``/``RMSNorm``, or a class named ``…Norm``, as transformers'
    ``LlamaRMSNorm``): per token, so it can run on sequence shards."""
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) or type(module).__name__.endswith("Norm")


def sequence_parallel_plan(module: nn.Module, fqn_styles: Mapping[str, str]) -> dict[str, str]:
    """The sequence-parallel plan derived from ``fqn_styles`` (full module names in ``module`` → style, as
    :func:`~lightning_par3d.parallel.tensor_parallel.expand_plan` gives them): see the module docstring. Raises
    ``ValueError`` naming every module it cannot place."""
    where = type(module).__name__
    already = sorted(name for name, style in fqn_styles.items() if canonical(style) in SEQUENCE_STYLES)
    if already:
        raise ValueError(
            f"sequence_parallel=True derives the sequence-parallel plan from a plain one, but the plan of {where} "
            f"already has sequence-parallel entries ({', '.join(already[:4])}). Use that plan with "
            "sequence_parallel=False, or give a plain plan."
        )
    blocks = _outer_blocks(module)
    if not blocks:
        raise ValueError(
            f"sequence_parallel=True splits the sequence between repeated blocks, but {where} has no ModuleList or "
            "ModuleDict of repeated blocks. Set sequence_parallel=False."
        )
    plan = {name: canonical(style) for name, style in fqn_styles.items()}
    problems: list[str] = []
    for block in blocks:
        problems += _block_entries(module, block, plan)
    problems += _after_blocks(module, blocks, plan)
    if problems:
        raise ValueError(
            f"sequence_parallel=True cannot derive a sequence-parallel plan for {where}:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nWrite the sequence-parallel entries yourself (rowwise_seq, gather_sequence, sequence_parallel, ...: "
            "docs/parallelism.md) and set sequence_parallel=False, or leave it off."
        )
    plan[blocks[0]] = "sequence_shard"
    return plan


def _outer_blocks(module: nn.Module) -> list[str]:
    """The names of the repeated blocks not inside another, in module order; one stack only."""
    names = {id(sub): name for name, sub in module.named_modules()}
    found = [names[id(block)] for sub in module.modules() for block in repeated_members(sub)]
    outer = [name for name in found if not any(name.startswith(other + ".") for other in found)]
    stacks = {name.rsplit(".", 1)[0] for name in outer}
    if len(stacks) > 1:
        raise ValueError(
            f"sequence_parallel=True needs one stack of repeated blocks, but {type(module).__name__} has "
            f"{len(stacks)} ({', '.join(sorted(stacks))}). Set sequence_parallel=False."
        )
    return outer


def _inside(name: str, parent: str) -> bool:
    return name.startswith(parent + ".")


def _block_entries(module: nn.Module, block: str, plan: dict[str, str]) -> list[str]:
    """Rewrites the entries inside ``block`` in ``plan``; returns what it cannot place."""
    inside = sorted(name for name in plan if _inside(name, block))
    whole = {name.rsplit(".", 1)[0] for name in inside if plan[name] in WHOLE_OWNERS} - {block}
    whole = {w for w in whole if not any(_inside(w, other) for other in whole)}
    problems = [f"{w} ({plan[w]}) holds {WHOLE_OWNERS[0]} experts: it must run on the whole sequence"
                for w in sorted(whole) if w in plan]  # fmt: skip
    inside = [name for name in inside if not _in_region(name, whole)]  # kept as the plain plan writes them
    gathered = {name.rsplit(".", 1)[0] for name in inside if plan[name] == "colwise"} - {block}
    gathered = {g for g in gathered if not any(_inside(g, other) for other in gathered)}
    problems += [_rewrite_entry(name, plan, gathered) for name in inside]
    for name in gathered:
        plan[name] = "gather_sequence"
    for name in whole:
        plan[name] = "whole_sequence"
    return [p for p in problems if p] + _residual_stream(module, block, plan, gathered | whole, inside)


def _in_region(name: str, regions: set[str] | list[str]) -> bool:
    return any(name == r or _inside(name, r) for r in regions)


def _rewrite_entry(name: str, plan: dict[str, str], gathered: set[str]) -> str:
    """Rewrites one entry inside a block; returns the problem, or ``""``."""
    style = plan[name]
    if name in gathered:
        return f"{name} ({style}) holds column-wise projections: it must gather the sequence"
    if style == "rowwise":
        plan[name] = "rowwise_seq"
    elif style == "colwise" and not _in_region(name, gathered):
        plan[name] = "colwise_seq"
    elif not (
        style in ("colwise", "replicated_with_grad_allreduce")
        or (style in IN_BLOCK_KEPT and _in_region(name, gathered))
    ):
        return (
            f"{name} ({style}): no sequence-parallel counterpart here (inside a block: colwise, rowwise, and "
            "replicated_with_grad_allreduce on the residual stream)"
        )
    return ""


def _residual_stream(
    module: nn.Module, block: str, plan: dict[str, str], gathered: set[str], inside: list[str]
) -> list[str]:
    """Makes the norms on ``block``'s residual stream (outside the gathered and planned modules) sequence-parallel;
    returns the other parameters there, which would see this rank's tokens only."""
    problems = []
    planned = [name for name in inside if name not in gathered]
    for name, sub in module.named_modules():
        if not (_inside(name, block) or name == block) or _in_region(name, gathered) or _in_region(name, planned):
            continue
        own = [p for p, _ in sub.named_parameters(recurse=False)]
        if is_norm(sub) and name != block:
            plan[name] = "sequence_parallel"
        elif own:
            problems.append(
                f"{name} ({type(sub).__name__}) holds {', '.join(own)} outside the plan and runs on the sequence "
                "shards: its gradient would be this rank's tokens' only. Give it a plan entry"
            )
    return problems


def _after_blocks(module: nn.Module, blocks: list[str], plan: dict[str, str]) -> list[str]:
    """Rewrites the norm and head after the last block; returns what would read sharded hidden states unplanned."""
    problems = []
    order = [name for name, _ in module.named_modules()]
    last = blocks[-1]
    end = max(i for i, name in enumerate(order) if name == last or _inside(name, last))
    after = [(name, module.get_submodule(name)) for name in order[end + 1 :]]
    claimed = [name for name, _ in after if name in plan]
    for name, sub in after:
        if any(_inside(name, c) for c in claimed if c != name):
            continue
        style = plan.get(name)
        if style is not None:
            if style not in HEAD_STYLES:
                problems.append(f"{name} ({style}) after the last block: use colwise_gather_output or colwise")
            else:
                plan[name] = HEAD_STYLES[style]
        elif is_norm(sub):
            plan[name] = "sequence_parallel"
        elif any(True for _ in sub.parameters(recurse=False)):
            problems.append(
                f"{name} ({type(sub).__name__}) after the last block is not in the plan, so it would read this "
                "rank's sequence shard only. Give it 'colwise_gather_output' (an LM head)"
            )
    return problems
