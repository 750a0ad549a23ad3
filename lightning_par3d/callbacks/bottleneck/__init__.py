"""``BottleneckReport``, one job per module: sampling the steps with ``torch.profiler`` (``sampling``), reading a
rank's trace back (``trace``), splitting each step into buckets (``analysis``), diagnosing and ranking the findings
(``findings``), what the run knows besides its steps (``context``), the predictions of the planning services
(``advising``), and the files and console lines (``writing``, ``timeline``); the Lightning callback that calls them
in order is ``callback``."""

from lightning_par3d.callbacks.bottleneck.callback import TRACES, BottleneckReport

__all__ = ["TRACES", "BottleneckReport"]
