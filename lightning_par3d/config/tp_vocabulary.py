"""The tensor-parallel style strings a plan may use, and what each stands for (plain names: the configuration checks
them before anything is built; :mod:`lightning_par3d.parallel.tp_styles` builds the torch ``ParallelStyle`` of each).

The names are Hugging Face transformers' ``tp_plan`` strings (version 5's, and 4.x's where they differ), so a
transformers model's own plan works as it is:

============================  ==========================================================================================
``colwise``                   ``ColwiseParallel()``: shard the weight's output dim (and the bias); the output stays
                              sharded on its last dim (attention computes its local heads from it). On
                              ``nn.Embedding``: shard the embedding dim. (4.x: ``local_colwise``)
``rowwise``                   ``RowwiseParallel()``: shard the weight's input dim; the partial outputs are all-reduced,
                              the bias added once. On ``nn.Embedding``: shard the vocabulary. (4.x: ``local_rowwise``)
``colwise_gather_output``     ``ColwiseParallel(output_layouts=Replicate())``: as colwise, then all-gather the output
                              (a vocabulary-parallel LM head whose logits every rank needs). (4.x: ``colwise_rep``)
``rowwise_split_input``       ``RowwiseParallel(input_layouts=Replicate())``: as rowwise for a layer whose input is
                              replicated; each rank takes its slice of the input. (4.x: ``rowwise_rep``)
``embedding_rowwise``         vocabulary-sharded ``nn.Embedding`` (token ids replicated, outputs all-reduced).
``embedding_colwise``         ``nn.Embedding`` sharded on the embedding dim, outputs all-gathered.
``packed_colwise``            a fused projection of two components (``gate_up_proj`` = [gate; up]): each component's
                              rows are split over the ranks, so rank ``r`` holds [gate_r; up_r] (``_StridedShard``) and
                              its output pairs its own gate and up columns.
``packed_rowwise``            the input dim of such a pair split the same way: each rank multiplies its [a_r | b_r]
                              columns by its part of the input; the partial outputs are all-reduced.
                              (4.x: ``local_packed_rowwise``)
``sequence_parallel``         ``SequenceParallel()``: a norm or dropout computed on sequence-sharded activations.
``replicated_with_grad_allreduce``  the parameters stay whole on every rank, which computes with them on its own part
                              of the activations (Qwen3's per-head ``q_norm``): their gradients are summed over the
                              tensor-parallel ranks.
``all_reduce``                the module's output is a partial sum on each rank: all-reduced. (4.x: ``gather``)
``local_params``              the module runs on its parameters' local shards (attention sinks), which entries naming
                              those parameters split.
``moe_tp_experts``            a mixture-of-experts block's experts (3-D weights, one slice per expert): every rank
                              runs every expert on its part of the expert's hidden size, from the whole (replicated)
                              tokens and routing weights; the partial outputs are all-reduced, and the gradients of
                              the tokens and routing weights summed in backward. The entries naming its parameters
                              split them (``experts.gate_up_proj``: ``packed_colwise``, ``experts.down_proj``:
                              ``rowwise``, as every transformers MoE plan says).
``replicate``                 parameters become replicated DTensors over the tp group; inputs and outputs stay local.
``rowwise_seq``               par3d: ``RowwiseParallel(output_layouts=Shard(1))``, reduce-scatter into sequence
                              shards, the entry to a sequence-parallel region.
``colwise_seq``               par3d: ``ColwiseParallel(input_layouts=Shard(1))``, all-gather the sequence shards
                              first, the exit from a sequence-parallel region.
``colwise_seq_gather_output`` par3d: ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())``: a
                              vocabulary-parallel LM head after a sequence-parallel final norm.
``sequence_shard``            par3d: the module's input (first tensor argument or ``hidden_states=``) is whole on every
                              rank; the module gets this rank's sequence shard (the first block's entry).
``gather_sequence``           par3d: the module's input is this rank's sequence shard; the module gets the whole
                              sequence, once for all the column-wise projections inside it (attention, MLP).
``whole_sequence``            par3d: as ``gather_sequence``, and the module's whole output is cut back to this rank's
                              sequence shard; the plain plan's entries inside it stay as written (a mixture-of-experts
                              block: its router and experts see every token, as without sequence parallelism).
============================  ==========================================================================================

**Entries naming a parameter.** A transformers plan also names parameters that are not modules' weights (a
mixture-of-experts block's 3-D ``experts.gate_up_proj``, attention sinks): such an entry splits that parameter
(:data:`PARAMETER_STYLES`: ``colwise`` and ``packed_colwise`` its second-to-last dimension, the output features;
``rowwise`` and ``packed_rowwise`` its last, the input features), and the module holding it needs a style that runs
on local shards (:data:`OWNER_STYLES`).

Expert-parallel styles (``ep_plan``'s) are refused in a tensor-parallel plan with a clear error:
:data:`REFUSED_STYLES`. ``sequence_parallel`` expects
sequence-sharded input, so use it between a ``rowwise_seq`` and a ``colwise_seq`` (the Megatron sequence-parallel
pattern): norms and dropout then run on 1/tp of the tokens. ``Par3DConfig(sequence_parallel=True)`` derives such a
plan from a plain one (:mod:`lightning_par3d.parallel.sequence_parallel`).
"""

from __future__ import annotations

CANONICAL_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "rowwise_split_input",
    "embedding_rowwise",
    "embedding_colwise",
    "packed_colwise",
    "packed_rowwise",
    "sequence_parallel",
    "replicated_with_grad_allreduce",
    "all_reduce",
    "local_params",
    "moe_tp_experts",
    "replicate",
    "rowwise_seq",
    "colwise_seq",
    "colwise_seq_gather_output",
    "sequence_shard",
    "gather_sequence",
    "whole_sequence",
)
ALIASES = {
    "colwise_rep": "colwise_gather_output",
    "rowwise_rep": "rowwise_split_input",
    "local_colwise": "colwise",
    "local_rowwise": "rowwise",
    "local_packed_rowwise": "packed_rowwise",
    "gather": "all_reduce",
}
"""transformers 4.x names → their 5.x equivalents."""
STYLE_NAMES = CANONICAL_STYLES + tuple(ALIASES)
"""Every style string par3d accepts."""
REFUSED_STYLES = {
    "moe_identity_expert": "an MoE zero expert",
    "grouped_gemm": "expert-parallel grouped GEMM weights",
    "ep_dispatch_experts": "expert-parallel token dispatch",
    "ep_router": "a 4.x expert-parallel router",
    "local": "4.x isolated MoE experts",
    "isolated": "4.x isolated MoE experts",
    "mla_kv_a_proj": "multi-head latent attention's KV projection",
}
"""Styles of mixture-of-experts (and MLA) models, which par3d does not parallelize yet."""
PARAMETER_STYLES = {"colwise": -2, "packed_colwise": -2, "rowwise": -1, "packed_rowwise": -1}
"""Styles an entry naming a parameter may have, and the dimension of the parameter each splits (from its end)."""
OWNER_STYLES = ("moe_tp_experts", "local_params")
"""Styles of a module whose parameters its plan's entries split one by one: the module runs on their local shards."""

SPLITTING_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "rowwise_split_input",
    "embedding_rowwise",
    "embedding_colwise",
    "packed_colwise",
    "packed_rowwise",
    "rowwise_seq",
    "colwise_seq",
    "colwise_seq_gather_output",
)
"""Styles that split a weight matrix: the dimension they split must divide by tp."""
SEQUENCE_STYLES = (
    "rowwise_seq",
    "colwise_seq",
    "colwise_seq_gather_output",
    "sequence_parallel",
    "sequence_shard",
    "gather_sequence",
    "whole_sequence",
)
"""Styles of a sequence-parallel plan."""
PACK = 2
"""Components of a packed projection (transformers' ``split_factor``: [gate; up])."""


def canonical(style: str) -> str:
    """The transformers-5 name of ``style`` (4.x names are accepted as aliases)."""
    return ALIASES.get(style, style)


def unknown_style_message(pattern: str, style: object) -> str:
    """The error for a plan entry whose style par3d does not apply, listing the known ones."""
    if style in REFUSED_STYLES:
        return (
            f"tp_plan[{pattern!r}]={style!r} is {REFUSED_STYLES[str(style)]}, which par3d's tensor parallelism does "
            "not apply. Remove the entry (the module then stays replicated); a mixture-of-experts block's experts "
            "split over tp with 'moe_tp_experts'."
        )
    return (
        f"tp_plan[{pattern!r}]={style!r} is not a tensor-parallel style. Allowed: {', '.join(map(repr, STYLE_NAMES))}."
    )
