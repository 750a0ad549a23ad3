"""Front-ends: thin glue from a framework's hooks to :class:`~lightning_par3d.engine.Par3DEngine`: the Lightning
Trainer strategy (``trainer``), the Fabric strategy (``fabric``), the Accelerate ``Accelerator`` (``accelerator``)
and the Hydra schema (``hydra_schema``)."""
