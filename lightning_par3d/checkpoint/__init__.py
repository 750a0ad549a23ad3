"""Sharded checkpoints with ``torch.distributed.checkpoint``: saving atomically, validating before loading, and
loading at any layout (``dcp``)."""
