"""Upstream warnings known to be noise, once per job instead of once per rank, or not at all.

Library code never silences a warning that a user's own code may trigger. The warnings below come from Lightning's
own code whatever the user writes; par3d's front-ends print each once per job (rank 0's,
:func:`known_upstream_warnings_once_per_job`, as Lightning's own ``rank_zero_warn`` does), and
:func:`quiet_known_upstream_warnings` (``lightning_par3d.quiet_known_upstream_warnings``, public) silences them
entirely, as par3d's own programs (``par3d smoke``, the examples) do:

* Lightning 2.6's ``isinstance(treespec, LeafSpec) is deprecated`` (a ``FutureWarning`` from
  ``lightning/pytorch/utilities/_pytree.py``, once per rank): Lightning's own use of torch's pytree API, which torch
  2.13 deprecates; nothing a user or par3d can change, and no behaviour differs.

FSDP2's "returned a view tensor" warning is handled in the library, where par3d causes it
(:func:`lightning_par3d.parallel.data_parallel.quiet_view_warning`).
"""

from __future__ import annotations

import warnings


def quiet_known_upstream_warnings() -> None:
    """Silences the warnings listed in the module docstring in this process (and, through the environment, in the
    ranks Lightning's launcher starts from it, which run the same program again)."""
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )


def known_upstream_warnings_once_per_job(rank: int) -> None:
    """On every rank but 0, silences the warnings of the module docstring: the job prints each once (rank 0's)."""
    if rank != 0:
        quiet_known_upstream_warnings()
