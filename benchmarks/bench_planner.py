"""The planner's predictions against measured step times: does ``lightning_par3d.planning.plan`` rank layouts as
they really run?

    python benchmarks/bench_planner.py [--models gpt,llama,qwen2] [--worlds 4,8] [--steps 8] [--warmup 3]
                                       [--select distinct|all] [--limit N] [--profile NAME] [--rounds 1]
                                       [--save FILE.json] [--replay FILE.json]

For each model and world size it plans on ``world`` ranks of this machine, calibrated by the planner itself
(``calibrate``, as many processes as ranks; ``--profile`` uses a named profile instead), then trains every layout
the plan lists as fitting (``--select distinct``: the best-predicted schedule and checkpointing of each size and ZeRO
stage; ``all``: every one) for ``--steps`` steps in one pool of gloo processes (``tests/harness.py``'s ``DistPool``,
as ``bench_strategies.py`` does), each run's step time the slowest rank's, the median of the steps after
``--warmup``. The models, each trained on the same byte-level data at a global batch of 16 × 64 tokens:

* ``gpt``: the example GPT of ``benchmarks/bench_strategies.py`` (4 layers, 128 wide);
* ``llama``: transformers' Llama, unchanged (``examples/hf_llama.py``: 4 layers, hidden 128, grouped-query
  attention with 2 key-value heads, its own tensor-parallel plan);
* ``qwen2``: transformers' Qwen2 the same way (biases on q, k, v; tied embeddings);
* ``qwen3`` (held out: ``--models qwen3``, not in the default set): transformers' Qwen3, an architecture the cost
  model and ``layout="auto"``'s rules were never fitted on (a norm on every query and key head, untied
  embeddings, 2 key-value heads). Its rows are reported apart in the summary.

It prints, per layout, the predicted and measured step, and per model and world:

* whether the plan's first choice is within 10 % of the best measured step;
* Spearman's rank correlation between predicted and measured steps;
* the median relative error of the prediction (``|predicted − measured| / measured``).

The pool's processes share the machine's cores as a run's ranks would, and the calibration measured them so. On a
shared or loaded machine both the calibration and the runs are noisy: compare on a quiet one.

``--save`` writes each case's machine figures and every measured layout's configuration and step times to a JSON
file; ``--replay`` reads one back and, measuring nothing, plans each case again with the cost model as it is now on
the saved machine and compares the new predictions with the saved measurements (a layout the new plan lists under
another configuration, or no longer lists, is left out and counted): how a change to the cost model is checked
without measuring again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from examples.gpt import GPTModule

MODEL = dict(block_size=64, n_layer=4, n_head=4, n_embd=128)
GLOBAL_BATCH = 16
SEQ = 64
HF_MODEL = dict(block_size=SEQ, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4)


def build_model(name: str) -> Any:
    """The LightningModule of ``name`` (see the module docstring), not yet configured."""
    if name == "gpt":
        return GPTModule(**MODEL)
    from examples.hf_llama import CausalLMModule

    if name == "llama":
        return CausalLMModule("llama", num_key_value_heads=2, **HF_MODEL)
    if name == "qwen2":
        return CausalLMModule("qwen2", num_key_value_heads=4, tie_word_embeddings=True, **HF_MODEL)
    if name == "qwen3":
        return CausalLMModule("qwen3", num_key_value_heads=2, **HF_MODEL)
    raise ValueError(f"--models: {name!r} is not a model here. Known: gpt, llama, qwen2, qwen3 (held out).")


HELD_OUT = ("qwen3",)
"""Models the cost model and ``layout="auto"``'s rules were never fitted on: reported apart."""


def timed_layout(config: Any, steps: int, warmup: int, model: str = "gpt") -> list[float]:
    """One training run of ``config`` in a pool worker; each kept step's time, the slowest rank's."""
    import lightning as L
    import torch.distributed as dist

    from benchmarks.bench_strategies import StepTimer, quiet_trainer
    from examples.data import ShakespeareDataModule
    from lightning_par3d import Par3DStrategy, resolve_layout

    L.seed_everything(0, verbose=False)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    layout = resolve_layout(config, world)
    assert layout is not None
    timer = StepTimer()
    strategy = Par3DStrategy(dataclasses.replace(config, timeout_s=300))
    trainer = quiet_trainer(strategy, world, steps, timer, "cpu")
    data = ShakespeareDataModule(block_size=SEQ, batch_size=GLOBAL_BATCH // layout.dp, max_bytes=200_000)
    trainer.fit(build_model(model), data)
    local = torch.tensor(timer.times[warmup:])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.tolist()


def ranks(values: list[float]) -> list[float]:
    """Ranks 1…n, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            result[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return result


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (Pearson's on the ranks); nan for fewer than 2 points or a constant side."""
    if len(a) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va and vb else float("nan")


def select(rows: list[Any], how: str, limit: int | None) -> list[Any]:
    """The fitting rows to measure: all, or the best-predicted one per (sizes, ZeRO stage)."""
    if how == "distinct":
        seen, picked = set(), []
        for row in rows:  # fastest first
            key = (row.layout.shape, row.layout.zero)
            if key not in seen:
                seen.add(key)
                picked.append(row)
        rows = picked
    return rows[:limit] if limit else rows


MEASURED = 3
"""``layout="auto"``'s default ``measure``: the fastest measured of the layouts it measures is its choice."""


def compare(rows: list[Any], measured: list[float]) -> dict[str, float]:
    """First choice vs the best measured (without measuring, and with ``layout="auto"``'s measuring: the fastest
    measured of the :data:`MEASURED` layouts it measures, :func:`~lightning_par3d.planning.table.to_measure`, and,
    for comparison, of the :data:`MEASURED` fastest predictions), rank correlation, median relative error.
    ``measured`` in the order of ``rows``, the prediction's. ``learned_choice_vs_best``: with the one more layout
    measured where the factors learned from those (:func:`~lightning_par3d.planning.learn.worth_measuring`) put
    another ahead."""
    from lightning_par3d.planning.learn import buckets_of, worth_measuring
    from lightning_par3d.planning.table import to_measure

    predicted = [row.time.total for row in rows]
    best = min(measured)
    errors = [abs(p - m) / m for p, m in zip(predicted, measured, strict=True)]
    picked = [i for i, row in enumerate(rows) if any(row is r for r in to_measure(rows, MEASURED))]
    others = [i for i in range(len(rows)) if i not in picked]
    extra, _ = worth_measuring(
        [(buckets_of(rows[i].time), measured[i]) for i in picked], [buckets_of(rows[i].time) for i in others]
    )
    learned = picked + ([others[extra]] if extra is not None else [])
    return {
        "first_choice_vs_best": measured[0] / best,
        "measured_choice_vs_best": min(measured[i] for i in picked) / best,
        "learned_choice_vs_best": min(measured[i] for i in learned) / best,
        "top_predictions_vs_best": min(measured[:MEASURED]) / best,
        "spearman": spearman(predicted, measured),
        "median_relative_error": statistics.median(errors),
    }


def machine_record(machine: Any) -> Any:
    """A machine (or a profile's name) as JSON."""
    return machine if isinstance(machine, str) else dataclasses.asdict(machine)


def machine_from(record: Any) -> Any:
    """:func:`machine_record`'s inverse."""
    from lightning_par3d.planning.machine import Link, Machine

    if isinstance(record, str):
        return record
    links = {k: Link(**record[k]) for k in ("intra_node", "inter_node")}
    fields = {f.name for f in dataclasses.fields(Machine)}
    kept = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in fields}  # JSON's lists
    return Machine(**{**kept, **links})


def config_record(config: Any) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(config).items() if isinstance(v, (int, float, str, bool, type(None)))}


def report(rows: list[Any], medians: list[float]) -> dict[str, Any]:
    """Prints the per-layout table and the comparison; returns the comparison."""
    print("\n| # | layout | predicted ms | measured ms | measured / predicted |")
    print("|---:|---|---:|---:|---:|")
    for i, (row, m) in enumerate(zip(rows, medians, strict=True), 1):
        print(f"| {i} | {row.describe()} | {row.time.total * 1e3:.1f} | {m * 1e3:.1f} | {m / row.time.total:.2f} |")
    result = compare(rows, medians)
    print(
        f"\nfirst choice: {medians[0] * 1e3:.1f} ms, best measured {min(medians) * 1e3:.1f} ms "
        f"(×{result['first_choice_vs_best']:.2f}; measuring {MEASURED} as layout='auto' does: "
        f"×{result['measured_choice_vs_best']:.2f}; the {MEASURED} fastest predictions: "
        f"×{result['top_predictions_vs_best']:.2f}); Spearman {result['spearman']:.2f}; median relative error "
        f"{result['median_relative_error']:.0%}",
        flush=True,
    )
    return result


def replay_case(case: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A saved case planned again with the cost model as it is now; compared with the saved measurements."""
    from lightning_par3d.planning import SearchSpace, plan

    model, world = case["model"], case["world"]
    machine = machine_from(case["machine"])
    described = machine if isinstance(machine, str) else machine.describe()
    print(f"\n## {model} on {world} ranks (replayed)\nmachine: {described}")
    table = plan(
        build_model(model), world, world, args.memory, global_batch=GLOBAL_BATCH, seq_len=SEQ, machine=machine,
        search=SearchSpace(),
    )  # fmt: skip
    saved = [(config_record(r.config), r) for r in table.fitting]
    rows, medians, missing = [], [], 0
    for layout in case["layouts"]:
        match = [r for c, r in saved if c == layout["config"]]
        if not match:
            missing += 1
            continue
        rows.append(match[0])
        medians.append(statistics.median(layout["measured_s"]))
    order = sorted(range(len(rows)), key=lambda i: rows[i].time.total)
    rows, medians = [rows[i] for i in order], [medians[i] for i in order]
    first = table.fitting[0]
    measured_first = config_record(first.config) in [config_record(r.config) for r in rows]
    print(f"new first choice: {first.describe()}" + ("" if measured_first else " (not among the measured layouts)"))
    if missing:
        print(f"{missing} measured layouts are not in the new plan under the same configuration (left out)")
    result = report(rows, medians)
    return {**result, "layouts": len(rows), "fitting": len(table.fitting), "first": rows[0].describe()}


def measure_case(model: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Plans ``model`` on ``world`` ranks and trains the selected fitting layouts; prints each and returns the
    comparison."""
    from lightning_par3d.planning import SearchSpace, calibrate, plan
    from tests.harness import DistPool

    started = time.perf_counter()
    machine: Any = args.profile or calibrate(world)
    described = machine if isinstance(machine, str) else machine.describe()
    print(f"\n## {model} on {world} ranks\nmachine ({time.perf_counter() - started:.1f} s): {described}", flush=True)
    started = time.perf_counter()
    table = plan(
        build_model(model), world, world, args.memory, global_batch=GLOBAL_BATCH, seq_len=SEQ, machine=machine,
        search=SearchSpace(),
    )  # fmt: skip
    print(f"plan: {len(table.fitting)} fitting layouts of {len(table)} ({time.perf_counter() - started:.1f} s)")
    rows = select(table.fitting, args.select, args.limit)
    pool = DistPool(world)
    measured: dict[int, list[float]] = {i: [] for i in range(len(rows))}
    run = dict(timeout=900, steps=args.steps, warmup=args.warmup, model=model)
    try:
        pool.run(timed_layout, config=rows[0].config, **{**run, "steps": args.warmup + 1})  # first-run costs
        for r in range(args.rounds):
            order = range(len(rows)) if r % 2 == 0 else reversed(range(len(rows)))
            for i in order:
                times = pool.run(timed_layout, config=rows[i].config, **run)
                measured[i].append(statistics.median(times[0]))
                print(
                    f"round {r + 1}/{args.rounds}  {rows[i].describe():48s} {measured[i][-1] * 1e3:8.1f} ms", flush=True
                )
    finally:
        pool.close()
    medians = [statistics.median(measured[i]) for i in range(len(rows))]
    result = report(rows, medians)
    saved = {
        "model": model, "world": world, "machine": machine_record(machine),
        "layouts": [{"config": config_record(row.config), "describe": row.describe(), "predicted_s": row.time.total,
                     "measured_s": measured[i]} for i, row in enumerate(rows)],
    }  # fmt: skip
    return {**result, "layouts": len(rows), "fitting": len(table.fitting), "first": rows[0].describe(), "saved": saved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt,llama,qwen2")
    parser.add_argument("--worlds", default="4,8")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="measure every layout this many times (median)")
    parser.add_argument("--select", choices=("distinct", "all"), default="distinct")
    parser.add_argument("--limit", type=int, default=None, help="measure at most this many layouts")
    parser.add_argument("--profile", default=None, help="plan with a named profile instead of calibrating")
    parser.add_argument("--memory", default="4GiB", help="memory per rank the plan may use")
    parser.add_argument("--save", default=None, help="write the machines and measurements to this JSON file")
    parser.add_argument("--replay", default=None, help="re-predict a --save file's measurements; measure nothing")
    args = parser.parse_args()
    if args.replay:
        saved = json.loads(Path(args.replay).read_text())
        results = {(c["model"], c["world"]): replay_case(c, args) for c in saved["cases"]}
    else:
        cases = [(m, int(w)) for m in args.models.split(",") for w in args.worlds.split(",")]
        results = {case: measure_case(*case, args) for case in cases}
        if args.save:
            cases_saved = [r.pop("saved") for r in results.values()]
            Path(args.save).write_text(json.dumps({"cases": cases_saved}, indent=1))
    machine_line = f"{os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}"
    runs = (
        f"replayed from {args.replay}"
        if args.replay
        else f"{args.steps - args.warmup} kept steps × {args.rounds} rounds per layout"
    )
    print(f"\n# Summary: {machine_line}; global batch {GLOBAL_BATCH} × {SEQ}; {runs}\n")
    print(f"| model | ranks | layouts measured | first choice | first vs best (measure=0) | with measure={MEASURED} "
          f"| within 10 % | {MEASURED} fastest predictions | Spearman | median error |")  # fmt: skip
    print("|---|---:|---:|---|---:|---:|---|---:|---:|---:|")
    ordered = sorted(results.items(), key=lambda item: item[0][0] in HELD_OUT)
    for (model, world), r in ordered:
        within = "yes" if r["measured_choice_vs_best"] <= 1.10 else "no"
        model = f"{model} (held out)" if model in HELD_OUT else model
        ratio, measured, top = r["first_choice_vs_best"], r["measured_choice_vs_best"], r["top_predictions_vs_best"]
        print(f"| {model} | {world} | {r['layouts']} of {r['fitting']} | {r['first']} | ×{ratio:.2f} | ×{measured:.2f} "
              f"| {within} | ×{top:.2f} | {r['spearman']:.2f} | {r['median_relative_error']:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
