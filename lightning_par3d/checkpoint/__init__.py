"""Sharded checkpoints with ``torch.distributed.checkpoint``: saving and loading at any layout (``dcp``), written
whole or not at all (``atomic``), read without running anything in them (``safe_reading``); Accelerate's
``save_state`` folders (``state_folders``), one file of a checkpoint (``consolidate``), each rank's random streams
(``rng``), Hugging Face weights in and out (``pretrained``) and peft's adapter files (``peft_files``)."""
