"""The benchmark scripts still run as their users run them, so that they cannot rot unnoticed between uses: one short
command each (``python benchmarks/bench_<name>.py`` with one round and a few steps), a background case
(``tests/background.py``), and what it prints is its table, every figure of it a number.

A figure is not checked against another here: timing on a machine the suite oversubscribes says nothing, and the
benchmarks' figures are read from their full runs (``docs/benchmarks.md``). What each table's rows are made of is
checked: the layouts, schedules, stages or modes it compares, each with its figures."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import background

ROOT = Path(__file__).resolve().parents[1]

COMMANDS: dict[str, list[str]] = {
    "strategies": ["--rounds", "0", "--launched-rounds", "1", "--steps", "3", "--warmup", "1", "--only", "dp2×tp2"],
    "pipeline_bubble": ["--steps", "3", "--microbatches", "4"],
    "zero": ["--dp", "2", "--rounds", "1", "--steps", "3", "--warmup", "1"],
    "callbacks": ["--rounds", "1", "--steps", "8", "--log-every", "4"],
    "async_save": ["--rounds", "1", "--steps", "3", "--every", "1", "--n-embd", "32", "--n-layer", "2"],
    "compile": ["--rounds", "1", "--steps", "3", "--warmup", "1", "--only", "dp2xtp2", "--modes", "eager"],
    "moe": ["--rounds", "1", "--steps", "3", "--warmup", "1", "--only", "ep=4"],
    "context": ["--seqs", "64", "--steps", "3", "--warmup", "1", "--cps", "2"],
    "plan_scale": ["--cases", "tiny"],
}
"""Each benchmark's short run: its own options, one round of few steps (and one layout where it compares many)."""

NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?"

ROWS: dict[str, list[str]] = {
    "strategies": [rf"\| dp2×tp2 \| {NUMBER} \| [^|]+ \| {NUMBER} \| {NUMBER} \|"],
    "pipeline_bubble": [rf"\| {schedule} \| 1 \| 4 \| {NUMBER} \|" for schedule in ("gpipe", "1f1b")],
    "zero": [  # the measured state, the formula's and the estimator's, equal (measured / formula 1.000)
        rf"\| 2 \| {stage} \| {NUMBER} \| {NUMBER} \| {NUMBER} \| (?P<t>{NUMBER}) \| (?P=t) \| (?P=t) \| 1\.000 \|"
        for stage in (0, 1, 2, 3)
    ],
    "callbacks": [rf"\| no callbacks \| {NUMBER} \| 1\.000 \|", rf"throughput change, medians: {NUMBER} %"],
    "async_save": [rf"\| {mode} \| {NUMBER} s \| {NUMBER} s \| {NUMBER} s \|" for mode in ("sync", "async")],
    "compile": [rf"\| dp2xtp2 \| {NUMBER} \| — \| — \| {NUMBER} \| — \|"],
    "moe": [rf"\| {name} \|(?: {NUMBER} \|){{5}} — \|" for name in ("fsdp", "ep=4")],
    "context": [rf"\| 2 \| dp_shard=2 × cp=2 \| 64 \|(?: {NUMBER} \|){{4}} — \|", r"\| 2 \| 64 \|"],
    "plan_scale": [
        rf"\| tiny \| 8 \|(?: {NUMBER} \|){{4}} — \| — \| pp\d",
        r"model: examples\.hf_llama\.CausalLMModule",
    ],
}
"""What each table must hold: a row per thing compared, with numbers where its figures go."""


def run(folder: Path, name: str) -> Any:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    command = [sys.executable, f"benchmarks/bench_{name}.py", *COMMANDS[name]]
    return background.run(command, timeout=900, cwd=ROOT, env={**env, "TMPDIR": str(folder)})


benchmark = background.fixture("benchmark", run, params=list(COMMANDS))


def test_every_benchmark_has_a_short_run():
    scripts = {path.stem.removeprefix("bench_") for path in (ROOT / "benchmarks").glob("bench_*.py")}
    longer = {"accelerate", "advice", "gpu", "planner"}  # minutes even when short; run from `make bench`/GPU CI
    assert scripts - longer == set(COMMANDS), scripts


def test_the_benchmark_runs_as_users_run_it_and_prints_its_table(benchmark, request: pytest.FixtureRequest):
    name = request.node.callspec.params["benchmark"]
    done = benchmark
    assert done.returncode == 0, f"{shlex.join(done.args)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    missing = [row for row in ROWS[name] if not re.search(row, done.stdout)]
    assert missing == [], f"{name}: no line matches {missing}\n{done.stdout[-3000:]}"
