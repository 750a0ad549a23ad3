"""The numbers the test modules share: the model, data and seed of the reference runs, the tolerances, the fault
tests' timeouts. A test module imports them from here, never from another test module."""

from __future__ import annotations

# ----------------------------------------------------------------------------------------- the reference runs
SEED = 1234
MODEL = dict(block_size=32, n_layer=2, n_head=4, n_embd=32, lr=3e-3, eps=1e-6)
"""The example GPT of every parity run (``examples/gpt.py``'s ``GPTModule`` arguments)."""
GLOBAL_BATCH = 8
"""Samples per optimizer step, over all data-parallel ranks together."""
DATA = dict(block_size=32, max_bytes=1282, val_fraction=0.2)
"""1282 bytes: 32 training windows of 32 bytes (4 steps of a global batch of 8 per epoch, divisible by every dp size
so that no sampler pads) and 8 validation windows."""
ONE_BATCH_EPOCHS = dict(max_bytes=322)
"""Data overrides for one global batch per epoch (8 training windows): every step sees the whole training set, so a
resumed run's trajectory does not depend on where Lightning's loop restarts its (non-stateful) DataLoader. Lightning
2.6 restarts a plain DataLoader from the beginning of the epoch, and after an end-of-epoch checkpoint runs one extra
batch of the next epoch's order, with its default single-device strategy too: that is the loop's behaviour, not the
strategy's. A resume test pins down the strategy's part: model and optimizer shards restored exactly."""

# ------------------------------------------------------------------------------------------------ tolerances
LOSS_RTOL = 1e-4
PARAM_RTOL = 1e-4
"""fp32 parity with the single-process run (``tests.conftest.assert_parity``)."""
BF16_MIXED_RTOL = 1e-3
"""bf16 keeps 8 significant bits: unit roundoff 2^-9 ≈ 2e-3 on every value autocast rounds. bf16-mixed rounds only
matmul inputs; the weights, the loss and its reduction stay fp32, and the rounding errors of a 32-wide dot product
average out over the 256 tokens of the mean loss. Measured: within 1.3e-4 of fp32 over 6 steps at every layout of
``tests/test_precision.py``. Tolerance 1e-3: half bf16's unit roundoff, 7× the measured worst case."""
BF16_TRUE_RTOL = 2e-2
"""bf16-true holds weights, gradients, Adam's moments and the loss itself in bf16: the loss (≈ 5) is a multiple of
2^-5, so rounding alone moves it by up to 0.3 %, and every update loses the digits below bf16's resolution.
Measured: within 0.84 %."""

# -------------------------------------------------------------------------------------------------- faults
FAULT_TIMEOUT_S = 20
"""``Par3DStrategy(timeout_s=...)`` of the fault script: a job must end within this + 30 s of its fault."""
FAULT_STEP = 3
"""The step at whose start the fault script injects its fault."""
FAULT_DATA = dict(max_bytes=257, val_fraction=0.0)
"""The fault script's data: 8 training windows, one global batch per epoch."""
THREADS_RANKS = 2
"""Ranks each launch of ``tests/threads_script.py`` starts: on a 2-core machine Lightning's rule gives each 1 thread,
where torch's default is 2, so a rank that missed the rule shows."""
