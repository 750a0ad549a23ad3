"""``from lightning_par3d.accelerate import Par3DAccelerator``: the Accelerate front-end (see
:mod:`lightning_par3d.integrations.accelerate`). Importing it needs the ``accelerate`` package."""

from lightning_par3d.integrations.accelerate import PRECISIONS, Par3DAccelerator

__all__ = ["PRECISIONS", "Par3DAccelerator"]
