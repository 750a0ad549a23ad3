"""From measured buckets to findings: severity, a concrete suggestion each, the Markdown report and its short form."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from lightning_par3d.callbacks.bottleneck.analysis import BUCKETS, COMPUTE_BUCKETS, StepTimes

SEVERITIES = (("critical", 0.40), ("high", 0.25), ("medium", 0.10), ("low", 0.0))
"""A bucket's severity by its share of the step: the first threshold it reaches."""

LABELS = {
    "forward": "forward compute",
    "backward": "backward compute",
    "optimizer": "optimizer step",
    "tp_comm": "tensor-parallel collectives",
    "dp_comm": "data-parallel collectives",
    "pipeline": "pipeline send/recv and idle (bubble)",
    "dataloader": "dataloader wait",
    "loop": "Lightning's loop between steps",
    "observer": "par3d's own measuring",
}


@dataclass
class RankSummary:
    """One rank's mean step over the sampled steps."""

    rank: int
    pp_rank: int
    step: StepTimes


@dataclass
class ReportContext:
    """What the suggestions need to know about the run."""

    layout: Any
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    num_workers: int | None = None
    devices_per_node: int = 1
    sampled_steps: int = 0
    tokens_per_step: int | None = None
    flops_per_step: int | None = None
    peak_flops: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    bucket: str
    fraction: float
    worst_fraction: float
    severity: str
    suggestion: str

    def line(self) -> str:
        return f"[{self.severity}] {self.suggestion}"


def severity(fraction: float) -> str:
    return next(name for name, threshold in SEVERITIES if fraction >= threshold)


def fractions(summaries: list[RankSummary]) -> dict[str, tuple[float, float]]:
    """Each bucket's share of the step: (mean over ranks, worst rank)."""
    out = {}
    for bucket in BUCKETS:
        shares = [s.step.buckets[bucket] / s.step.cycle_us for s in summaries if s.step.cycle_us > 0]
        out[bucket] = (sum(shares) / len(shares), max(shares)) if shares else (0.0, 0.0)
    return out


def diagnose(summaries: list[RankSummary], context: ReportContext) -> list[Finding]:
    """Every non-compute bucket as a finding, worst first."""
    findings = []
    for bucket, (mean, worst) in fractions(summaries).items():
        if bucket in COMPUTE_BUCKETS:
            continue
        findings.append(Finding(bucket, mean, worst, severity(mean), suggest(bucket, mean, context)))
    return sorted(findings, key=lambda f: f.fraction, reverse=True)


def _dataloader(share: str, context: ReportContext) -> str:
    workers = "" if context.num_workers is None else f" (now {context.num_workers})"
    return f"dataloader wait {share}: raise num_workers{workers}, and use pin_memory=True on GPUs."


def _pipeline(share: str, context: ReportContext) -> str:
    m, pp = context.microbatches, context.layout.pp
    if context.schedule in ("gpipe", "1f1b"):
        better = f"raise microbatches to {max(4 * pp, 2 * m)} or use interleaved_1f1b (virtual_stages=2)"
    else:
        better = f"raise microbatches to {max(4 * pp, 2 * m)} or use zbv_zero_bubble"
    return f"pipeline idle {share} at microbatches={m} ({context.schedule}, pp={pp}): {better}."


def _tp_comm(share: str, context: ReportContext) -> str:
    node = f", and keep tp within a node ({context.devices_per_node} devices per node)"
    return f"tensor-parallel all-reduce/all-gather {share}: lower tp (now {context.layout.tp}){node}."


def _dp_comm(share: str, context: ReportContext) -> str:
    layout = context.layout
    if layout.zero == 3:
        fix = (
            "use zero_stage=2 or 1 (no per-block all-gathers), replicate across nodes (dp_replicate), "
            "or raise the per-rank batch"
        )
    elif layout.zero == 0:
        fix = "raise the per-rank batch or accumulate_grad_batches, or compress gradients (grad_compression)"
    else:
        fix = "raise the per-rank batch or accumulate_grad_batches"
    return f"data-parallel collectives {share} (ZeRO-{layout.zero}, dp={layout.dp}): {fix}."


def _optimizer(share: str, context: ReportContext) -> str:
    layout = context.layout
    if layout is not None and layout.tp > 1 and layout.zero != 3:
        # Without FSDP, tensor-parallel (DTensor) and plain parameters share the optimizer's groups, which then take
        # the per-tensor path (parallel/optimizer_paths.py).
        return (
            f"optimizer step {share}: shard the parameters with ZeRO-3 (dp_shard > 1), so that every parameter is a "
            "DTensor and the optimizer can take its foreach/fused path."
        )
    return f"optimizer step {share}: use a foreach/fused optimizer, or shard it (zero_stage=1)."


_SUGGESTIONS = {
    "dataloader": _dataloader,
    "pipeline": _pipeline,
    "tp_comm": _tp_comm,
    "dp_comm": _dp_comm,
    "optimizer": _optimizer,
    "loop": lambda share, _: (
        f"Lightning's loop between steps {share}: log less often (log_every_n_steps), checkpoint less often, and keep "
        "callbacks' per-step work light."
    ),
    "observer": lambda share, _: (
        f"par3d's own measuring (MemoryStats) {share}: log less often (MemoryStats(log_every_n_steps=...))."
    ),
}


ADVICE_BUCKETS = {
    "pipeline": ("pipeline",),
    "tp_comm": ("tp_comm",),
    "dp_comm": ("dp_comm",),
    "optimizer": ("dp_comm",),
    "dataloader": ("dataloader",),
}
"""A finding's bucket → the buckets of the changes that address it (``planning.advice.Change.bucket``)."""


def with_advice(findings: list[Finding], advice: list[Any]) -> list[Finding]:
    """Each finding whose bucket the predicted changes address, with its suggestion replaced by what was predicted:
    the best change predicted to help, or that every change weighed is predicted slower or within the run's noise
    (with each one's prediction). Findings no change addresses (Lightning's loop, par3d's measuring) keep their
    text."""
    out = []
    for finding in findings:
        mine = [a for a in advice if a.change.bucket in ADVICE_BUCKETS.get(finding.bucket, ())]
        helping = [a for a in mine if a.suggested]
        share = f"{LABELS[finding.bucket]} {finding.fraction:.0%} of step"
        if helping:
            text = f"{share}: try {helping[0].line()}."
        elif any(a.predicted_s is not None for a in mine):
            costs = "; ".join(a.line() for a in mine if a.predicted_s is not None)
            within_noise = any(a.gain is not None and a.gain > 0 for a in mine)
            verdict = "within this run's noise" if within_noise else "slower"
            text = f"{share}: every change weighed is predicted {verdict} ({costs})."
        else:
            out.append(finding)
            continue
        out.append(replace(finding, suggestion=text))
    return out


def advice_lines(advice: list[Any], error: str | None) -> list[str]:
    """The advice's headline for the console: the best suggestion, or that none is predicted to help."""
    if error is not None:
        return [f"advice: not predicted ({error})"]
    if not advice:
        return []
    best = advice[0]
    if best.suggested:
        return [f"advice: {best.line()} (predicted from this run's measurements; verify with a short run)"]
    return ["advice: no change weighed is predicted to make the step faster beyond this run's noise"]


def suggest(bucket: str, fraction: float, context: ReportContext) -> str:
    """A concrete suggestion for ``bucket`` at this share of the step."""
    share = f"{fraction:.0%} of step"
    make = _SUGGESTIONS.get(bucket)
    return make(share, context) if make is not None else f"{LABELS.get(bucket, bucket)} {share}."


def throughput(summaries: list[RankSummary], context: ReportContext) -> tuple[float | None, float | None]:
    """(tokens per second, model FLOPs utilization) from the mean step time."""
    cycle_s = sum(s.step.cycle_us for s in summaries) / max(len(summaries), 1) / 1e6
    if cycle_s <= 0:
        return None, None
    tokens = context.tokens_per_step / cycle_s if context.tokens_per_step else None
    mfu = None
    if context.flops_per_step and context.peak_flops:
        mfu = context.flops_per_step / cycle_s / (context.peak_flops * context.layout.world_size)
    return tokens, mfu


def render_markdown(
    summaries: list[RankSummary],
    findings: list[Finding],
    context: ReportContext,
    advice: list[Any] | None = None,
    advice_error: str | None = None,
) -> str:
    """The full report: findings, the predicted effect of each change weighed, throughput, and every rank's
    buckets."""
    layout = context.layout
    tokens, mfu = throughput(summaries, context)
    lines = [
        "# par3d bottleneck report",
        "",
        f"Layout {layout}, ZeRO-{layout.zero}"
        + (f", {context.schedule} with {context.microbatches} microbatches" if layout.pp > 1 else "")
        + f"; measured with torch.profiler over {context.sampled_steps} steps on every rank.",
        "",
        "## Findings, worst first",
        "",
        "| severity | bucket | share of step (mean) | worst rank | suggestion |",
        "|---|---|---:|---:|---|",
    ]
    lines += [
        f"| {f.severity} | {LABELS[f.bucket]} | {f.fraction:.1%} | {f.worst_fraction:.1%} | {f.suggestion} |"
        for f in findings
    ]
    lines += _advice_table(advice or [], advice_error)
    lines += ["", "## Throughput", ""]
    lines.append(f"- tokens/s: {tokens:,.0f}" if tokens is not None else "- tokens/s: unknown (no token count)")
    if mfu is not None:
        lines.append(f"- MFU: {mfu:.1%} (model FLOPs {context.flops_per_step:.3g} per step)")
    else:
        lines.append("- MFU: n/a (no peak-FLOPs figure for this device)")
    lines += ["", "## Per rank (ms per step)", ""]
    header = "| rank | pp rank | step | " + " | ".join(LABELS[b] for b in BUCKETS) + " | accounted |"
    lines += [header, "|" + "---:|" * (len(BUCKETS) + 4)]
    for s in summaries:
        cells = " | ".join(f"{s.step.buckets[b] / 1e3:.2f}" for b in BUCKETS)
        accounted = s.step.accounted_us / s.step.cycle_us if s.step.cycle_us else 0.0
        lines.append(f"| {s.rank} | {s.pp_rank} | {s.step.cycle_us / 1e3:.2f} | {cells} | {accounted:.0%} |")
    kinds = _kinds(summaries)
    if kinds:
        lines += ["", "Exposed time of each kind of collective (mean over ranks, ms per step):"]
        lines.append(", ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines) + "\n"


def _advice_table(advice: list[Any], error: str | None) -> list[str]:
    if error is not None:
        return ["", f"No predicted advice: {error}."]
    if not advice:
        return []
    lines = [
        "",
        "## Changes weighed, with their predicted step",
        "",
        "Predicted from this run's measured buckets through the planner's cost model (lightning_par3d.planning."
        "advice); suggested only where predicted faster than the measured step by more than the run's noise.",
        "",
        "| change | addresses | predicted step | vs measured | suggested |",
        "|---|---|---:|---:|---|",
    ]
    for a in advice:
        predicted = f"{a.predicted_s * 1e3:,.1f} ms" if a.predicted_s is not None else f"— ({a.reason})"
        versus = f"{-(a.gain or 0.0):+.0%}" if a.predicted_s is not None else "—"
        lines.append(f"| {a.change.description} | {a.change.bucket} | {predicted} | {versus} | "
                     f"{'yes' if a.suggested else 'no'} |")  # fmt: skip
    return lines


def _kinds(summaries: list[RankSummary]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for s in summaries:
        for k, v in s.step.comm_kinds.items():
            totals[k] = totals.get(k, 0.0) + v / len(summaries)
    return totals


def short_summary(
    summaries: list[RankSummary],
    findings: list[Finding],
    context: ReportContext,
    advice: list[Any] | None = None,
    advice_error: str | None = None,
) -> str:
    """A few lines for the console at the end of fit."""
    cycle = sum(s.step.cycle_us for s in summaries) / max(len(summaries), 1) / 1e3
    compute = sum(fractions(summaries)[b][0] for b in COMPUTE_BUCKETS)
    tokens, mfu = throughput(summaries, context)
    head = f"par3d bottlenecks: step {cycle:.1f} ms, compute {compute:.0%}"
    if tokens is not None:
        head += f", {tokens:,.0f} tokens/s"
    if mfu is not None:
        head += f", MFU {mfu:.1%}"
    shown = [f for f in findings if f.severity != "low"][:3] or findings[:1]
    extra = advice_lines(advice or [], advice_error) if advice is not None or advice_error else []
    return "\n".join([head, *(f"  {f.line()}" for f in shown), *(f"  {line}" for line in extra)])
