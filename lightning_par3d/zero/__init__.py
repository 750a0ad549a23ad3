"""ZeRO stages 1 and 2: the optimizer wrapper (``optimizer``), its buckets (``buckets``) and state dicts
(``state``), and the per-stage memory formulas (``formula``). Stage 3 is FSDP2 (``lightning_par3d.parallel``)."""
