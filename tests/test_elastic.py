"""Elastic runs (``Par3DStrategy(elastic=True)``): a run that loses half its ranks and gets them back goes on at the
layout each world allows, with the same global batch and the same global sample order, and stays on the
single-process trajectory.

The job trains dp_shard=2 × tp=2 (and pp=2 × dp_shard=2) on 4 ranks and writes ``last.ckpt`` at every step; it
stops mid-epoch (as a lost node stops it), resumes on 2 ranks (``ckpt_path="last"``: tp=2 (pp=2) kept, dp 2 -> 1,
``accumulate_grad_batches`` 1 -> 2), crosses an epoch there, stops mid-epoch again and resumes on 4 ranks: in the
pool at both layouts, and under torchrun's elastic agent, with a node killed and one added, at dp_shard=2 × tp=2.
Every optimizer step's loss, the samples each step read (from the batches' own contents, on every rank) and the final
parameters are compared with one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DistributedSampler

from examples.data import ShakespeareDataModule
from examples.gpt import GPTModule
from lightning_par3d import Par3DConfig
from lightning_par3d.config import resolve_layout
from lightning_par3d.engine.elastic import ElasticSampler, accumulation_for, relayout
from tests import background
from tests.conftest import assert_parity
from tests.constants import DATA, GLOBAL_BATCH, MODEL, SEED
from tests.gpt_runs import StepRecorder, full_state, run_reference, trainer_kwargs
from tests.hf_runs import TINY
from tests.launch import clean_env, start, wait_all
from tests.padded_runs import PaddedData, PaddedLM
from tests.padded_runs import run_reference as run_padded_reference
from tests.ports import free_port

RANK_BATCH = 4
"""Samples per data-parallel rank and batch, the same at every world size (the user's DataModule)."""
LAYOUT = dict(dp_shard=2, tp=2)


def elastic_job(
    layout: dict[str, Any], ckpt_dir: str, max_steps: int, resume: bool, padded: bool = False
) -> dict[str, Any]:
    """The elastic run on the pool's ranks: the example GPT, or (``padded``) a transformers Llama on padded rows of
    different real lengths (:mod:`tests.padded_runs`)."""
    from lightning_par3d import Par3DStrategy

    L.seed_everything(SEED, verbose=False)
    strategy = Par3DStrategy(Par3DConfig(**layout, elastic=True, timeout_s=120))
    recorder = StepRecorder()
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0, every_n_train_steps=1)
    world = int(os.environ["WORLD_SIZE"])  # the pool's ranks, as torchrun gives them
    kwargs = trainer_kwargs(max_steps=max_steps, enable_checkpointing=True)
    trainer = L.Trainer(devices=world, strategy=strategy, callbacks=[recorder, saver], **kwargs)
    if padded:
        module: L.LightningModule = PaddedLM(**TINY)
        data: ShakespeareDataModule = PaddedData("left", batch_size=RANK_BATCH, **DATA)
    else:
        module, data = GPTModule(**MODEL), ShakespeareDataModule(batch_size=RANK_BATCH, **DATA)
    trainer.fit(module, data, ckpt_path="last" if resume else None)
    return {
        "steps": recorder.steps,
        "params": full_state(module),
        "accumulate": trainer.accumulate_grad_batches,
        "layout": str(strategy.layout),
    }


def reference_rows(padded: bool = False) -> list[set[tuple[int, ...]]]:
    """The input rows of each optimizer step of the single-process run: ``GLOBAL_BATCH`` samples at a time of the
    seeded DistributedSampler's permutation, epoch after epoch."""
    data = PaddedData("left", batch_size=GLOBAL_BATCH, **DATA) if padded else ShakespeareDataModule(**DATA)
    data.setup()
    steps = []
    for epoch in range(2):
        sampler = DistributedSampler(data.train_set, num_replicas=1, rank=0, shuffle=True, seed=SEED)
        sampler.set_epoch(epoch)
        order = list(sampler)
        for first in range(0, len(order), GLOBAL_BATCH):
            rows = [data.train_set[i] for i in order[first : first + GLOBAL_BATCH]]
            steps.append({tuple((row["input_ids"] if padded else row[0]).tolist()) for row in rows})
    return steps


ELASTIC_LAYOUTS = [LAYOUT, dict(pp=2, dp_shard=2, microbatches=2), dict(cp=2, dp_shard=2)]
"""On 4 ranks; on 2, tp=2 alone, pp=2 alone and cp=2 alone."""


def layout_id(layout: dict[str, Any]) -> str:
    return "x".join(f"{k}{v}" for k, v in layout.items())


@pytest.mark.parametrize("layout", ELASTIC_LAYOUTS, ids=layout_id)
def test_a_run_that_loses_half_its_ranks_and_gets_them_back_stays_on_the_single_process_trajectory(
    pool4, pool2, tmp_path: Path, layout: dict[str, Any]
):
    ckpt = str(tmp_path / "ckpt")
    first = pool4.run(elastic_job, layout=layout, ckpt_dir=ckpt, max_steps=3, resume=False)[0]
    smaller = pool2.run(elastic_job, layout=layout, ckpt_dir=ckpt, max_steps=6, resume=True)[0]
    again = pool4.run(elastic_job, layout=layout, ckpt_dir=ckpt, max_steps=8, resume=True)[0]

    assert (first["accumulate"], smaller["accumulate"], again["accumulate"]) == (1, 2, 1)
    assert "dp_replicate=1 × dp_shard=1" in smaller["layout"] and "dp_shard=2" in again["layout"]
    assert sorted(first["steps"]) == [0, 1, 2]
    assert sorted(smaller["steps"]) == [3, 4, 5]
    assert sorted(again["steps"]) == [6, 7]
    steps = {**first["steps"], **smaller["steps"], **again["steps"]}
    expected_rows = reference_rows()
    for step in range(8):
        assert steps[step]["rows"] == expected_rows[step], f"step {step} read other samples than one process"
    got = {"losses": [steps[s]["loss"] for s in range(8)], "params": again["params"]}
    assert_parity(got, run_reference(max_steps=8))


def test_an_elastic_run_on_padded_rows_keeps_the_global_token_mean(pool4, pool2, tmp_path: Path):
    """The token mean follows the global batch, not the layout: on 2 ranks the window of 2 accumulated batches holds
    what dp=2 held in one batch, and each step's loss and gradient stay the token mean of the same 8 samples."""
    ckpt, layout = str(tmp_path / "ckpt"), dict(pp=2, dp_shard=2, microbatches=2)
    first = pool4.run(elastic_job, layout=layout, ckpt_dir=ckpt, max_steps=3, resume=False, padded=True)[0]
    smaller = pool2.run(elastic_job, layout=layout, ckpt_dir=ckpt, max_steps=6, resume=True, padded=True)[0]
    again = pool4.run(elastic_job, layout=layout, ckpt_dir=ckpt, max_steps=8, resume=True, padded=True)[0]
    assert (first["accumulate"], smaller["accumulate"], again["accumulate"]) == (1, 2, 1)
    steps = {**first["steps"], **smaller["steps"], **again["steps"]}
    expected_rows = reference_rows(padded=True)
    for step in range(8):
        assert steps[step]["rows"] == expected_rows[step], f"step {step} read other samples than one process"
    got = {"losses": [steps[s]["loss"] for s in range(8)], "params": again["params"]}
    assert_parity(got, run_padded_reference("left", max_steps=8))


# ---------------------------------------------------------------- the pieces, in one process


def test_relayout_keeps_pp_and_tp_and_gives_data_parallelism_the_rest():
    config = Par3DConfig(dp_shard=2, tp=2, elastic=True)
    assert relayout(config, 4) == (config, None)
    smaller, note = relayout(config, 2)
    assert (smaller.tp, smaller.dp_shard, smaller.dp_replicate) == (2, 1, 1) and note is not None
    assert "elastic: 2 ranks, so pp=1 × dp_replicate=1 × dp_shard=1 × tp=2" in note
    hsdp, _ = relayout(Par3DConfig(dp_replicate=2, dp_shard=2, pp=2, elastic=True), 16)
    assert (hsdp.pp, hsdp.dp_replicate, hsdp.dp_shard) == (2, 2, 4)
    with pytest.raises(ValueError, match=r"a world of 2 ranks cannot keep pp=1 × tp=4 = 4, which must divide"):
        relayout(Par3DConfig(tp=4, elastic=True), 2)
    context, note = relayout(Par3DConfig(cp=2, tp=2, dp_shard=2, elastic=True), 4)
    assert (context.cp, context.tp, context.dp_shard) == (2, 2, 1)
    assert note is not None and "pp=1 × tp=2 × cp=2 kept" in note
    with pytest.raises(ValueError, match=r"cannot keep pp=1 × tp=1 × cp=4 = 4.*or lower tp, pp or cp"):
        relayout(Par3DConfig(cp=4, elastic=True), 6)
    experts, note = relayout(Par3DConfig(dp_shard=8, ep=4, elastic=True), 6)  # dp_shard 6: ep 4 → 2
    assert (experts.dp_shard, experts.ep) == (6, 2) and note is not None and "ep=4 → ep=2" in note
    kept, note = relayout(Par3DConfig(dp_shard=8, ep=4, elastic=True), 4)
    assert (kept.dp_shard, kept.ep) == (4, 4) and note is not None and "ep=" not in note.split("(")[-1]
    folded, _ = relayout(Par3DConfig(dp_shard=2, cp=2, ep=4, elastic=True), 6)  # dp_shard 3 × cp 2: ep 2
    assert (folded.dp_shard, folded.cp, folded.ep) == (3, 2, 2)


def test_accumulation_keeps_the_global_batch_or_says_why_it_cannot():
    layout = resolve_layout(Par3DConfig(dp_shard=2, tp=2), 4)
    assert layout is not None
    assert accumulation_for(16, 4, layout) == 2
    with pytest.raises(ValueError, match=r"global batch is 12 samples.*4 × dp=2 = 8 samples, which does not divide"):
        accumulation_for(12, 4, layout)
    with pytest.raises(ValueError, match=r"Use a per-rank batch size that divides 6, or a world whose data-parallel"):
        accumulation_for(12, 4, layout)
    wide = resolve_layout(Par3DConfig(dp_shard=8), 8)
    assert wide is not None
    with pytest.raises(ValueError, match=r"No per-rank batch size can at dp=8: launch a world whose .* divides 12"):
        accumulation_for(12, 1, wide)


def test_the_sampler_is_distributed_samplers_order_from_any_global_position():
    data = list(range(37))  # 37: DistributedSampler pads to a multiple of the replicas
    for replicas in (1, 2, 4):
        for rank in range(replicas):
            ours, theirs = (
                ElasticSampler(data, replicas, rank, seed=7),
                DistributedSampler(data, replicas, rank, seed=7),
            )
            ours.set_epoch(3)
            theirs.set_epoch(3)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)
    for replicas in (1, 2, 4):
        order = ElasticSampler(data, replicas, 0, seed=7).order()
        read = [i for r in range(replicas) for i in ElasticSampler(data, replicas, r, seed=7, start_sample=8)]
        assert sorted(read) == sorted(order[8:])  # the epoch's rest, each position once
        later = ElasticSampler(data, replicas, 1 % replicas, seed=7, start_sample=8)
        later.set_epoch(1)  # another epoch than the one resumed starts at its beginning
        reference = DistributedSampler(data, replicas, 1 % replicas, seed=7)
        reference.set_epoch(1)
        assert list(later) == list(reference)


# ---------------------------------------------------------------- under torchrun's elastic agent, a node lost and back

AGENT_TIMEOUT_S = 420


def _wait_for(path: Path, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or all(p.poll() is not None for p in procs):
            raise AssertionError(f"{path.name} was not written within {timeout:.0f} s (or every agent ended)")
        time.sleep(0.2)


def _events(folder: Path) -> list[dict[str, Any]]:
    path = folder / "times.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def elastic_agents(folder: Path, layout: dict[str, Any]) -> dict[str, Any]:
    """Two torchrun agents (``--nnodes 1:2``) train 8 steps; at step 3 the second "node" (its agent and its workers)
    is SIGKILLed, and the first agent restarts alone at world 2; at step 5 a third agent joins, and the run goes on
    at world 4 to the end."""
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=3",
        "--monitor-interval=0.5", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=par3d-elastic", "--rdzv-conf=last_call_timeout=15,join_timeout=300",
        "tests/elastic_script.py", str(folder), json.dumps(layout), "8",
    ]  # fmt: skip
    env = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # as the README says: a node can join later
    agents = [start(command, folder, 0, env)]
    try:
        _wait_for_port(port, agents)  # the first agent hosts the rendezvous store, as the endpoint's node does
        agents.append(start(command, folder, 1, env))
        _wait_for(folder / "lose_node", agents, AGENT_TIMEOUT_S)
        killed_at = time.time()
        background.kill_group(agents[1].pid)
        _kill_pids([e["pid"] for e in _events(folder) if e["event"] == "script_start" and e["rank"] in (2, 3)])
        _wait_for(folder / "add_node", agents[:1], AGENT_TIMEOUT_S)
        agents.append(start(command, folder, 2, env))
        outcomes = wait_all({0: agents[0], 2: agents[2]}, folder, timeout=AGENT_TIMEOUT_S)
    finally:
        for agent in agents:
            background.kill_group(agent.pid)
            background.forget(agent.pid)
        _kill_pids([e["pid"] for e in _events(folder)])
    return {"folder": folder, "killed_at": killed_at, "outcomes": outcomes}


def _wait_for_port(port: int, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and procs[0].poll() is None:
        with socket.socket() as s, contextlib.suppress(OSError):
            s.connect(("127.0.0.1", port))
            return
        time.sleep(0.2)
    raise AssertionError(f"the first agent did not open its rendezvous store on port {port} within {timeout} s")


TORCHRUN_LAYOUTS = [LAYOUT]
"""Under torchrun, dp_shard=2 × tp=2 only: what the agents add to the pool's runs (a killed node, a restart, a node
that joins, the rendezvous store) is the same at every layout, and each launch costs about 10 interpreters. (pp=2 ×
dp_shard=2 passed there too, at the same recovery time; the pool runs it.)"""

elastic_run = background.fixture(
    "elastic_run",
    elastic_agents,
    order=0,  # among the first: its agents wait out rendezvous rounds, which overlap the suite's work there
    params=TORCHRUN_LAYOUTS,
    ids=layout_id,
)


def recovery(events: list[dict[str, Any]], killed_at: float) -> dict[str, float]:
    """Seconds from the kill to each milestone of the first launch at world 2."""

    def first(event: str, **match: Any) -> float:
        times = [e["time"] for e in events if e["event"] == event and e["time"] >= killed_at
                 and all(e.get(k) == v for k, v in match.items())]  # fmt: skip
        return min(times) - killed_at

    return {
        "failure seen": first("failure_seen"),
        "restarted (rendezvous done, script started)": first("script_start", world=2),
        "process group and mesh": first("process_group_and_mesh", world=2),
        "checkpoint loaded": first("checkpoint_loaded"),
        "first step": first("first_step", world=2),
    }


def test_torchrun_loses_a_node_and_gets_it_back_and_the_run_stays_on_the_single_process_trajectory(elastic_run):
    folder = elastic_run["folder"]
    for code, out in elastic_run["outcomes"]:
        assert code == 0, out[-4000:]
    records: dict[int, dict[str, Any]] = {}
    for line in (folder / "steps.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record  # a step trained again after a resume: its last record
    assert sorted(records) == list(range(8))
    assert [records[s]["world"] for s in range(8)] == [4, 4, 4, 2, 2, 4, 4, 4]
    expected_rows = reference_rows()
    for step in range(8):
        assert {tuple(r) for r in records[step]["rows"]} == expected_rows[step], f"step {step} read other samples"
    got = {"losses": [records[s]["loss"] for s in range(8)], "params": torch.load(folder / "final.pt")}
    assert_parity(got, run_reference(max_steps=8))
    times = recovery(_events(folder), elastic_run["killed_at"])
    print("recovery after the node was killed (s): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    printed = "".join(out for _, out in elastic_run["outcomes"])
    assert "accumulate_grad_batches 1 -> 2 keeps the global batch of 8 samples" in printed
    assert "accumulate_grad_batches 2 -> 1 keeps the global batch of 8 samples" in printed


def restart_after_failure(folder: Path) -> dict[str, Any]:
    """One torchrun agent, with its default store shared across restarts (the case
    ``lightning_par3d.distributed.groups.restart_store`` exists for): rank 1 raises at step 3, the agent restarts
    both workers, which resume ``last.ckpt`` and train to step 6."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
        "--monitor-interval=0.5", "tests/elastic_script.py", str(folder), json.dumps({"dp_shard": 2}), "6",
    ]  # fmt: skip
    env = clean_env(PAR3D_FAIL_ONCE="1:3")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    [(code, out)] = wait_all({0: start(command, folder, 0, env)}, folder, timeout=AGENT_TIMEOUT_S)
    return {"code": code, "out": out, "folder": folder, "events": _events(folder)}


restart_run = background.fixture("restart_run", restart_after_failure, order=0)


def test_a_restart_after_a_failure_with_torchruns_shared_store_resumes_on_the_single_process_trajectory(restart_run):
    assert restart_run["code"] == 0, restart_run["out"][-4000:]
    starts = [e for e in restart_run["events"] if e["event"] == "script_start"]
    assert sorted(e["restart_count"] for e in starts) == ["0", "0", "1", "1"]  # two launches of two workers
    assert {e["use_agent_store"] for e in starts} == {"True"}  # the agent's store, shared by both launches
    assert "injected failure on rank 1 at step 3" in restart_run["out"]
    records: dict[int, dict[str, Any]] = {}
    for line in (restart_run["folder"] / "steps.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    assert sorted(records) == list(range(6))
    got = {"losses": [records[s]["loss"] for s in range(6)], "params": torch.load(restart_run["folder"] / "final.pt")}
    assert_parity(got, run_reference(max_steps=6))


def too_small(folder: Path) -> dict[str, Any]:
    """The restart after a loss that left 2 ranks to a run whose tp=4 needs 4: torchrun starts 2 workers."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
        "tests/elastic_script.py", str(folder), json.dumps({"tp": 4}), "8",
    ]  # fmt: skip
    [(code, out)] = wait_all({0: start(command, folder, 0, clean_env())}, folder, timeout=AGENT_TIMEOUT_S)
    return {"code": code, "out": out, "ended_at": time.time(), "events": _events(folder)}


too_small_run = background.fixture("too_small_run", too_small)


def test_a_world_too_small_for_the_fixed_sizes_ends_the_job_with_the_reason(too_small_run):
    from tests.elastic_script import TIMEOUT_S

    assert too_small_run["code"] != 0
    message = "elastic: a world of 2 ranks cannot keep pp=1 × tp=4 = 4, which must divide the world size"
    # The reason, before any process group exists. (Each rank raises it; torchrun's agent stops the other worker as
    # soon as one has failed, so under a busy suite the second may be stopped before it prints, or even before its
    # imports are done and it has started at all.)
    assert message in too_small_run["out"], too_small_run["out"][-3000:]
    starts = [e for e in too_small_run["events"] if e["event"] == "script_start"]
    assert 1 <= len(starts) <= 2, starts
    # From the ranks' start (their imports done: under a busy test suite, imports alone can take most of a minute)
    # to the job's end: the reason comes at setup, not after a collective's timeout.
    assert too_small_run["ended_at"] - max(e["time"] for e in starts) < TIMEOUT_S + 30
    pids = [e["pid"] for e in starts]
    for pid in pids:  # nothing left behind
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_front_ends_that_cannot_keep_the_promises_refuse_elastic():
    from lightning_par3d import Par3DFabricStrategy
    from lightning_par3d.engine.elastic import check_front_end

    with pytest.raises(ValueError, match=r"Par3DFabricStrategy\(elastic=True\): .* only the Trainer's strategy"):
        Par3DFabricStrategy(elastic=True)
    with pytest.raises(ValueError, match=r"Par3DAccelerator\(elastic=True\)"):
        check_front_end("Par3DAccelerator", Par3DConfig(elastic=True))
    check_front_end("Par3DStrategy", Par3DConfig(elastic=True))
