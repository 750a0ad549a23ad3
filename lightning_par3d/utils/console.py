"""What par3d's own programs (``par3d smoke``, the examples) do to keep the console readable.

Library code never silences a warning that a user's own code may trigger. A program of par3d's, which runs a model
it controls, silences the upstream warnings that are known to be noise there, each one named here with why:

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
