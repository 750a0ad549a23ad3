"""Many nodes, on one machine: a user's script (``tests/multinode_script.py``) under two torchrun agents that meet by
c10d rendezvous on localhost, and under SLURM's variables with no launcher, as ``srun`` starts it. Each trains the
example GPT at layouts that span both "nodes" of 2 ranks and matches the single-process run; the mesh's groups sit
where the launcher's node numbering says they should (tp and HSDP's shards inside a node, HSDP's replicas and the
pipeline's stages across), and tp across nodes is trained too, with the warning that names its cost.

Each launch is a background case (``tests/background.py``): one launch trains all its layouts in the same processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import background
from tests.conftest import assert_parity
from tests.gpt_runs import run_reference
from tests.launch import ROOT, clean_env, start, wait_all
from tests.ports import free_port

SCRIPT = "tests/multinode_script.py"
NODES, PER_NODE = 2, 2
TORCHRUN_LAYOUTS: list[dict[str, Any]] = [
    {"dp_shard": 2, "tp": 2},  # tp inside a node, FSDP across the two
    {"dp_replicate": 2, "dp_shard": 2},  # HSDP: shards inside a node, replicas across
    {"pp": 2, "dp_shard": 2, "microbatches": 2},  # pipeline stages across nodes
    {"tp": 4},  # tp across nodes: trains, with a warning
]
SLURM_LAYOUTS: list[dict[str, Any]] = [{"dp_shard": 2, "tp": 2}]
NODE_LOCAL_CHECKPOINTS = "checkpoints"
"""The torchrun launch's last run checkpoints into this directory of each agent's own working directory."""


def torchrun_agents(folder: Path) -> tuple[Path, list[tuple[int, str]]]:
    """Two torchrun agents (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on localhost), each in a session of
    its own as two machines' agents would be, each in a working directory of its own (``folder/node<i>``): the
    last run's checkpoint directory, in the working directory, is then a different directory on each "node", as a
    node-local disk mounted at the same path would be."""
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc-per-node={PER_NODE}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=par3d-multinode", "--max-restarts=0",
        str(ROOT / SCRIPT), str(folder), json.dumps(TORCHRUN_LAYOUTS), str(NODES), NODE_LOCAL_CHECKPOINTS,
    ]  # fmt: skip
    places = [folder / f"node{i}" for i in range(NODES)]
    for place in places:
        place.mkdir()
    procs = {i: start(command, folder, i, clean_env(), cwd=places[i]) for i in range(NODES)}
    return folder, wait_all(procs, folder)


def slurm_tasks(folder: Path) -> tuple[Path, list[tuple[int, str]]]:
    """Four processes with the variables ``srun --nodes 2 --ntasks-per-node 2`` gives its tasks, and no launcher:
    Lightning's SLURM environment finds the world, and par3d its nodes."""
    world = NODES * PER_NODE
    common = dict(
        SLURM_NTASKS=str(world), SLURM_NTASKS_PER_NODE=str(PER_NODE), SLURM_NNODES=str(NODES),
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="par3d-test", SLURM_NODELIST="127.0.0.1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
    )  # fmt: skip
    procs = {
        rank: start(
            [sys.executable, SCRIPT, str(folder), json.dumps(SLURM_LAYOUTS), str(NODES)],
            folder,
            rank,
            clean_env(
                **common, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % PER_NODE), SLURM_NODEID=str(rank // PER_NODE)
            ),
        )
        for rank in range(world)
    }
    return folder, wait_all(procs, folder)


torchrun_run = background.fixture("torchrun_run", torchrun_agents, order=0)  # early: its rendezvous waits overlap
slurm_run = background.fixture("slurm_run", slurm_tasks)


def check_launch(outcomes: list[tuple[int, str]]) -> None:
    for code, out in outcomes:
        assert code == 0, out[-4000:]


def places(folder: Path, i: int) -> list[dict[str, Any]]:
    return [json.loads((folder / f"place{i}_{rank}.json").read_text()) for rank in range(NODES * PER_NODE)]


def nodes_of(group: list[int], node: dict[int, int]) -> set[int]:
    return {node[r] for r in group}


def check_parity(folder: Path, i: int) -> None:
    got = torch.load(folder / f"run{i}.pt")
    assert_parity(got, run_reference())


@pytest.mark.parametrize("i", range(len(TORCHRUN_LAYOUTS)), ids=[json.dumps(c) for c in TORCHRUN_LAYOUTS])
def test_two_torchrun_agents_train_a_layout_that_spans_both_nodes_as_one_process_does(torchrun_run, i):
    folder, outcomes = torchrun_run
    check_launch(outcomes)
    check_parity(folder, i)


def test_groups_sit_where_the_launcher_put_the_nodes(torchrun_run):
    """tp and HSDP's shards inside a node; HSDP's replicas and the pipeline's stages across; tp=4 across, with the
    warning (printed once, by rank 0)."""
    folder, outcomes = torchrun_run
    check_launch(outcomes)
    by_layout = [places(folder, i) for i in range(len(TORCHRUN_LAYOUTS))]
    for found in by_layout:
        node = {p["rank"]: p["node"] for p in found}
        assert node == {r: r // PER_NODE for r in range(NODES * PER_NODE)}, "ranks are numbered node by node"
    node = {r: r // PER_NODE for r in range(NODES * PER_NODE)}
    dp_tp, hsdp, pipeline, wide_tp = by_layout
    assert all(len(nodes_of(p["tp"], node)) == 1 for p in dp_tp)
    assert all(len(nodes_of(p["dp_shard"], node)) == 2 for p in dp_tp)
    assert all(len(nodes_of(p["dp_shard"], node)) == 1 for p in hsdp)
    assert all(len(nodes_of(p["dp_replicate"], node)) == 2 for p in hsdp)
    assert all(len(nodes_of(p["pp"], node)) == 2 for p in pipeline)
    assert all(len(nodes_of(p["dp_shard"], node)) == 1 for p in pipeline)
    assert all(len(nodes_of(p["tp"], node)) == 2 for p in wide_tp)
    printed = "".join(out for _, out in outcomes)
    assert printed.count("puts tensor-parallel groups across nodes") == 1, printed[-4000:]  # tp=4's, on rank 0
    assert "tp=4 puts tensor-parallel groups across nodes of 2 devices each" in printed
    assert "Keep tp a divisor of 2 (tp=2)" in printed


def test_ranks_started_as_slurm_starts_them_train_as_one_process_does(slurm_run):
    folder, outcomes = slurm_run
    check_launch(outcomes)
    check_parity(folder, 0)
    found = places(folder, 0)
    node = {p["rank"]: p["node"] for p in found}
    assert node == {r: r // PER_NODE for r in range(NODES * PER_NODE)}
    assert all(len(nodes_of(p["tp"], node)) == 1 for p in found)


def test_a_checkpoint_directory_that_some_node_does_not_see_is_refused_before_training(torchrun_run):
    """The last run of the torchrun launch checkpoints into ``checkpoints`` in each agent's working directory, at
    one path (``/proc/self/cwd/checkpoints``): a disk of each node's own. Every rank refuses it at setup, naming the
    directory and the node that does not see rank 0's file, before any step; rank 0's probe file is gone."""
    folder, outcomes = torchrun_run
    check_launch(outcomes)
    said = [(folder / f"shared{rank}.txt").read_text() for rank in range(NODES * PER_NODE)]
    for message in said:
        assert f"The checkpoint directory /proc/self/cwd/{NODE_LOCAL_CHECKPOINTS} is" in message, message
        assert "is not shared by every node: node 1 (" in message and "node 0 (" not in message, message
        assert "Put the checkpoints on storage every node mounts at the same path" in message
    written = [
        p for i in range(NODES) if (d := folder / f"node{i}" / NODE_LOCAL_CHECKPOINTS).exists() for p in d.iterdir()
    ]
    assert written == [], written  # no checkpoint, and no probe left
    assert not (folder / "trained_node_local").exists()
