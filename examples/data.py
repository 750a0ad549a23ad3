"""A LightningDataModule over the bundled slice of Tiny Shakespeare, as byte tokens (vocabulary 256).

Nothing is downloaded: ``examples/data/tinyshakespeare_200k.txt`` holds the first 200 kB of the public-domain
corpus. Each sample is a window of ``block_size + 1`` bytes; the input is its first ``block_size`` bytes and the
target the last ``block_size`` (next-byte prediction).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

BUNDLED_TEXT = Path(__file__).parent / "data" / "tinyshakespeare_200k.txt"


class ByteWindows(Dataset):
    """Non-overlapping windows of a byte string, each giving (input, target) shifted by one byte."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]  # (block_size + 1,)
        return chunk[:-1], chunk[1:]


class ShakespeareDataModule(L.LightningDataModule):
    """Train/validation split of the bundled text (the last ``val_fraction`` is validation).

    ``batch_size`` is per data-parallel rank, as everywhere in Lightning: the global batch is
    ``batch_size × dp``. ``max_bytes`` limits the text used (tests keep it small).
    """

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 64,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        max_bytes: int | None = None,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.path = Path(path) if path else BUNDLED_TEXT
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.shuffle = shuffle
        self.num_workers = num_workers

    def setup(self, stage: str | None = None) -> None:
        raw = self.path.read_bytes()[: self.max_bytes]
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        split = int(len(data) * (1 - self.val_fraction))
        self.train_set = ByteWindows(data[:split], self.block_size)
        self.val_set = ByteWindows(data[split:], self.block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, self.batch_size, shuffle=self.shuffle, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.batch_size, shuffle=False, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The held-out windows again (the bundled text has no separate test split)."""
        return self.val_dataloader()
