"""What the cost model knows about the hardware: a :class:`Machine`, its :class:`Link` s, and named profiles.

A machine is a handful of numbers per device: how fast it multiplies matrices in each precision, what one eager
op costs beyond its arithmetic, how fast it streams memory (the optimizer step), and the latency and bandwidth of
its links within a node and across nodes. They come from a short measurement on the machine the planner runs on
(:func:`lightning_par3d.planning.calibrate.calibrate`) or from a named profile (:data:`PROFILES`), whose figures
and their sources are given below.

Profile figures and where they come from
----------------------------------------

``h100-sxm-8`` (an 8-GPU HGX/DGX H100 node, H100 SXM5 80 GB):

* matmul peaks, from NVIDIA's *H100 Tensor Core GPU* datasheet (SXM column): FP32 67 TFLOPS (the CUDA cores:
  PyTorch computes fp32 matmuls in full fp32 unless TF32 is enabled), BF16 and FP16 Tensor Core 1,979 TFLOPS
  *with sparsity*, so 989.5 TFLOPS dense; the planner uses the dense figures;
* memory bandwidth 3.35 TB/s (the same datasheet, HBM3); GPU memory 80 GB (sold as 80 GB, 80 GiB usable);
* within a node: NVLink 4, 900 GB/s per GPU (datasheet; both directions together), so 450 GB/s each way;
* across nodes: the *DGX H100* datasheet lists 8 single-port ConnectX-7 adapters at 400 Gb/s, one per GPU, so
  50 GB/s per GPU each way.

``a100-sxm4-8`` (an 8-GPU HGX/DGX A100 node, A100 SXM4 80 GB):

* NVIDIA's *A100 Tensor Core GPU* datasheet: FP32 19.5 TFLOPS, BF16 and FP16 Tensor Core 312 TFLOPS (dense; 624
  with sparsity); HBM2e 2,039 GB/s; NVLink 3, 600 GB/s per GPU (300 GB/s each way);
* across nodes: the *DGX A100* datasheet lists 8 single-port ConnectX-6 adapters at 200 Gb/s (HDR InfiniBand),
  25 GB/s per GPU each way.

Figures that no datasheet gives are assumptions, the same for both profiles, and named so here:

* ``compute_efficiency`` 0.5: the share of the dense peak that a training step's matmuls reach (a typical model
  FLOPs utilization of well-tuned dense transformer training);
* ``link_efficiency`` 0.8: the share of a link's bandwidth that NCCL's ring collectives reach (its all-reduce
  "bus bandwidth" on NVLink and InfiniBand sits around this share of the line rate);
* latency per ring step (α): 2 µs within a node, 6 µs across nodes (NCCL's small-message latency is tens of
  microseconds for a whole collective over 8 to 16 GPUs, which the ring formulas spread over their ``2(n−1)``
  steps);
* ``op_overhead_s`` 8 µs: what eager PyTorch spends on the CPU per aten op (dispatch and kernel launch); on a GPU it
  overlaps the kernels, so a step costs the larger of the two (``async_kernels``);
* ``dtensor_op_overhead_s`` 30 µs: the same for an op on a DTensor (its sharding propagation and unwrapping, in
  Python), what FSDP2's and tensor parallelism's optimizer steps and layer boundaries pay.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Link:
    """A link's cost for the ring algorithms: ``latency_s`` (α) per step, ``bandwidth`` (β) in bytes per second
    per device, each way, and the measured :attr:`reduce_scatter_factor` (ρ) and :attr:`all_to_all_factor`."""

    latency_s: float
    bandwidth: float
    reduce_scatter_factor: float = 1.0
    """A reduce-scatter's time over an all-gather's of the same size (the ring formulas give both the same: NCCL
    runs them so; gloo's reduce-scatter costs several all-gathers on CPU cores), measured by a calibration."""
    all_to_all_factor: float = 1.0
    """An all-to-all's time over an all-gather's whose output is the all-to-all's buffer (both move ``(n−1)/n`` of
    it per rank; NCCL's pairwise exchange runs at the ring's pace), measured by a calibration."""

    def __post_init__(self) -> None:
        if not self.latency_s >= 0 or not self.bandwidth > 0:
            raise ValueError(
                f"A link needs a latency ≥ 0 s and a bandwidth > 0 bytes/s; got latency_s={self.latency_s!r}, "
                f"bandwidth={self.bandwidth!r}."
            )


PRECISION_FAMILY = {"32-true": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16"}
"""Lightning's precision flag → the number format its matmuls run in."""


@dataclass(frozen=True)
class Machine:
    """One device's figures, and its links; see the module docstring for the profiles' sources."""

    name: str
    matmul_flops: dict[str, float]
    """Achievable matmul FLOP/s per device by number format (``"fp32"``, ``"bf16"``, ``"fp16"``), already
    multiplied by ``compute_efficiency`` for a profile (a calibration measures achieved figures)."""
    op_overhead_s: float
    """Seconds per eager aten op beyond its arithmetic (dispatch, autograd, kernel launch)."""
    dtensor_op_overhead_s: float
    """Seconds per op on a DTensor (sharding propagation and unwrapping, beyond the op itself)."""
    memory_bandwidth: float
    """Bytes per second one device streams (the optimizer step reads and writes every state element)."""
    intra_node: Link
    inter_node: Link
    tp_module_s: tuple[float, float] = (0.0, 0.0)
    """Seconds a tensor-parallel module costs beyond its plain ops, (forward, backward) per microbatch: its input
    wrapped into a DTensor, its layer's ops dispatched on DTensors, its output redistributed and unwrapped, and their
    autograd functions in backward. A calibration measures it; (0, 0) on the profiles, where the cost model counts
    ``DTENSOR_OPS_PER_TP_MODULE`` DTensor ops in each instead."""
    split_backward_op_s: float = 0.0
    """Seconds torch's zero-bubble schedules add per backward op by splitting a stage's backward into its input
    gradient (``I``) and weight gradient (``W``): ``stage_backward_input`` walks the autograd graph in Python to
    find what the weight gradients need, hooks it and keeps it, and ``stage_backward_weight`` runs the second pass
    from there. CPU work, measured by a calibration; 0 on the profiles (not measured there)."""
    pipeline_action_s: float = 0.0
    """Seconds a pipeline schedule spends per action (a stage's forward or backward of one microbatch) beyond the
    stage's own ops and its transfers: torch's schedule bookkeeping, the point-to-point ops' setup and waits. A
    calibration measures it (a do-nothing pipeline over pairs of ranks); 0 on the profiles, where it overlaps the
    GPU's work."""
    async_kernels: bool = True
    """True on GPUs: the CPU's per-op work overlaps the device's arithmetic, so compute costs the larger of the two
    (False on CPUs: they add)."""
    overlap_communication: bool = True
    """True where data-parallel collectives run beside compute (NCCL's own streams): only what outlasts the
    compute they overlap is exposed. False for gloo on CPU cores, where they compete with compute."""
    devices_per_node: int | None = None
    """The node's device count, a default for the planner (None: must be given)."""
    device_memory: int | None = None
    """Bytes of memory per device, a default for the planner (None: must be given)."""
    source: str = ""
    """Where the figures come from."""
    measurements: dict[str, float] = field(default_factory=dict)
    """A calibration's raw figures (seconds and bytes), for the record."""

    def flops_for(self, precision: str) -> float:
        """Matmul FLOP/s for Lightning's ``precision`` flag (fp32 where the machine gives no figure for it)."""
        family = PRECISION_FAMILY.get(precision, "fp32")
        return self.matmul_flops.get(family) or self.matmul_flops["fp32"]

    def describe(self) -> str:
        """One line: the figures the cost model uses."""
        flops = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in self.matmul_flops.items())
        return (
            f"{self.name}: matmul {flops}; {self.op_overhead_s * 1e6:.1f} µs per op, "
            f"{self.dtensor_op_overhead_s * 1e6:.1f} µs per DTensor op; memory "
            f"{self.memory_bandwidth / 1e9:.3g} GB/s; in a node α {self.intra_node.latency_s * 1e6:.1f} µs, "
            f"β {self.intra_node.bandwidth / 1e9:.3g} GB/s; across nodes α {self.inter_node.latency_s * 1e6:.1f} µs, "
            f"β {self.inter_node.bandwidth / 1e9:.3g} GB/s"
            + (
                f"; reduce-scatter ×{self.intra_node.reduce_scatter_factor:.2g} an all-gather"
                if self.intra_node.reduce_scatter_factor != 1.0
                else ""
            )
            + (
                f"; all-to-all ×{self.intra_node.all_to_all_factor:.2g} an all-gather"
                if self.intra_node.all_to_all_factor != 1.0
                else ""
            )
            + (f"; {self.pipeline_action_s * 1e3:.2g} ms per pipeline action" if self.pipeline_action_s else "")
            + (
                f"; per tensor-parallel module {self.tp_module_s[0] * 1e3:.2g} ms forward, "
                f"{self.tp_module_s[1] * 1e3:.2g} ms backward"
                if any(self.tp_module_s)
                else ""
            )
            + (
                f"; zero-bubble split {self.split_backward_op_s * 1e6:.2g} µs per backward op"
                if self.split_backward_op_s
                else ""
            )
        )


_COMPUTE_EFFICIENCY = 0.5
_LINK_EFFICIENCY = 0.8


def _gpu_profile(
    name: str,
    fp32: float,
    half: float,
    hbm: float,
    nvlink_each_way: float,
    network_each_way: float,
    memory: int,
    source: str,
) -> Machine:
    return Machine(
        name=name,
        matmul_flops={
            "fp32": fp32 * _COMPUTE_EFFICIENCY,
            "bf16": half * _COMPUTE_EFFICIENCY,
            "fp16": half * _COMPUTE_EFFICIENCY,
        },
        op_overhead_s=8e-6,
        dtensor_op_overhead_s=30e-6,
        memory_bandwidth=hbm,
        intra_node=Link(2e-6, nvlink_each_way * _LINK_EFFICIENCY),
        inter_node=Link(6e-6, network_each_way * _LINK_EFFICIENCY),
        async_kernels=True,
        overlap_communication=True,
        devices_per_node=8,
        device_memory=memory,
        source=source,
    )


PROFILES: dict[str, Machine] = {
    "h100-sxm-8": _gpu_profile(
        "h100-sxm-8",
        fp32=67e12,
        half=989.5e12,
        hbm=3.35e12,
        nvlink_each_way=450e9,
        network_each_way=50e9,
        memory=80 * 2**30,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM), DGX H100 datasheet; efficiencies assumed (see "
        "lightning_par3d.planning.machine)",
    ),
    "a100-sxm4-8": _gpu_profile(
        "a100-sxm4-8",
        fp32=19.5e12,
        half=312e12,
        hbm=2.039e12,
        nvlink_each_way=300e9,
        network_each_way=25e9,
        memory=80 * 2**30,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB), DGX A100 datasheet; efficiencies assumed (see "
        "lightning_par3d.planning.machine)",
    ),
}
"""Named hardware profiles; the module docstring gives every figure's source."""


def machine_profile(name: str, **overrides: object) -> Machine:
    """The profile ``name`` (see :data:`PROFILES`), with fields replaced by ``overrides`` (e.g. a slower
    ``inter_node=Link(...)`` for another network)."""
    if name not in PROFILES:
        raise ValueError(
            f"machine={name!r} is not a known profile. Known: {', '.join(map(repr, PROFILES))}; or pass a Machine, "
            "or calibrate this machine with lightning_par3d.planning.calibrate()."
        )
    return replace(PROFILES[name], **overrides)  # type: ignore[arg-type]


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | float | str) -> int:
    """Bytes from a number or a size such as ``"80GiB"``, ``"80 GB"`` or ``"512MiB"`` (GB = 10⁹, GiB = 2³⁰)."""
    if isinstance(value, bool):
        raise ValueError(f"device_memory={value!r} is not a size. Give bytes (an int) or a size such as '80GiB'.")
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"device_memory={value!r} is not a size. Give bytes (an int) or a number with a unit: "
            "'80GiB', '80GB', '512MiB' (GB = 10^9 bytes, GiB = 2^30)."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    """``n`` bytes in the unit that suits it (KiB, MiB, GiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:.0f} B"
