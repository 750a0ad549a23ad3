"""The README and the docs say what works: the quick start is the two commands CI's entry point relies on, and every
command a reader is told to type (each line of a ```` ```bash ```` block of ``README.md`` and ``docs/*.md`` that starts
with ``python``, ``par3d`` or ``accelerate launch``) runs, from the repository root, with the venv's interpreter, as
a background case (``tests/background.py``). A run that trains is shortened: the Hydra app gets ``trainer.max_steps``
(6 where the bottleneck report samples, which then skips two steps instead of five, else 3) and a run folder of its
own; the other examples their own step options. GPU, multi-node and placeholder commands live in
```` ```shell ```` blocks, which are shown, not run here (the GPU tiers run on GPU machines: ``tests/test_gpu.py``,
``docs/gpu-ci.md``)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests import background

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STARTS = ("python ", "par3d ", "accelerate launch ")


def commands_in(page: Path) -> list[str]:
    """The commands of ``page``'s ```` ```bash ```` blocks, continuation lines joined."""
    found, block, pending = [], None, ""
    for line in page.read_text().splitlines():
        fence = re.match(r"^\s*```(\S*)", line)
        if fence:
            block = None if block is not None else fence.group(1)
            continue
        if block != "bash":
            continue
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1].strip() + " "
            continue
        pending = ""
        command = text.split(" #")[0].strip()
        if command.startswith(STARTS):
            found.append(command)
    return found


COMMANDS = sorted({command for page in PAGES for command in commands_in(page)})


def shortened(command: str, folder: Path) -> list[str]:
    """The command as this test runs it: the venv's interpreter and launchers, fewer steps, its own run folder."""
    words = shlex.split(command)
    bin_dir = Path(sys.executable).parent
    if words[0] == "python":
        words[0] = sys.executable
    elif words[0] in ("par3d", "accelerate"):
        words[0] = str(bin_dir / words[0])
    if "examples/train.py" in words:
        trains = not any(w.startswith("mode=") for w in words) or "mode=train" in words
        sampled = any(w in words for w in ("experiment=demo", "callbacks=observe"))
        if trains and sampled:  # the report's 3 steps after the 2 it must skip (5 as configured), and one more
            words += ["trainer.max_steps=6", "callbacks.bottleneck_report.skip_first=2"]
        elif trains:
            words += ["trainer.max_steps=3"]
        if trains:
            words += ["trainer.limit_val_batches=2"]
        words += [f"hydra.run.dir={folder / 'run'}", f"hydra.sweep.dir={folder / 'sweep'}"]
    words = [re.sub(r"^steps=\d+$", "steps=3", w) for w in words]  # the Accelerate example's Hydra option
    words = [re.sub(r"^--trainer\.max_steps=\d+$", "--trainer.max_steps=3", w) for w in words]  # LightningCLI
    if "examples/cli.py" in words:  # LightningCLI writes its logs and its config.yaml here
        words += [f"--trainer.default_root_dir={folder / 'run'}"]
    if "--steps" in words and "examples/fabric_train.py" in words:
        words[words.index("--steps") + 1] = "3"
    if "--out" in words:
        words[words.index("--out") + 1] = str(folder / "out")
    return words


def run(folder: Path, command: str) -> tuple[Path, subprocess.CompletedProcess]:
    """The run's folder (``run/`` in it: the Hydra app's and LightningCLI's output) and the finished command."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    return folder, background.run(shortened(command, folder), timeout=900, cwd=ROOT, env=env)


documented = background.fixture("documented", run, params=COMMANDS, ids=lambda c: c[:90])
"""The documented commands' runs. A test that checks more of one of them takes its run, not one of its own:
``@pytest.mark.parametrize("documented", [command], indirect=True)`` (the command as the docs give it)."""


def test_every_documented_command_runs(documented):
    _, done = documented
    assert done.returncode == 0, f"{shlex.join(done.args)}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_the_docs_show_commands_and_the_quick_start_is_two_commands():
    assert len(COMMANDS) >= 10, COMMANDS
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert quick.split() == ["make", "demo", "make", "test"], quick
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\nmake test\n" in ci, "CI's entry point runs the README's test command"


def test_the_collector_reads_bash_blocks_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\npython a.py x=1  # why\npar3d plan --a \\\n    --b\nmake demo\n```\n"
        "```shell\npython gpu.py\n```\n```text\npython not-a-command\n```\n"
    )
    assert commands_in(page) == ["python a.py x=1", "par3d plan --a --b"]


def test_a_shortened_command_keeps_the_documented_words_and_only_shortens_the_run(tmp_path):
    """What the docs' runs change of a command: the interpreter and launchers of the venv, fewer steps, a run folder
    of their own; every word the reader types stays, in order."""
    trains = shortened("python examples/train.py experiment=dp2_tp2 trainer.max_steps=50", tmp_path)
    assert trains[0] == sys.executable and trains[1:3] == ["examples/train.py", "experiment=dp2_tp2"]
    assert trains[3:6] == ["trainer.max_steps=50", "trainer.max_steps=3", "trainer.limit_val_batches=2"]  # last wins
    assert trains[6:] == [f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    sampled = shortened("python examples/train.py experiment=demo", tmp_path)
    assert "trainer.max_steps=6" in sampled and "callbacks.bottleneck_report.skip_first=2" in sampled
    plans = shortened("par3d plan --model-config conf/model/gpt.yaml --world-size 8", tmp_path)
    assert plans == [str(Path(sys.executable).parent / "par3d"), "plan", "--model-config", "conf/model/gpt.yaml",
                     "--world-size", "8"]  # fmt: skip
    fabric = shortened("python examples/fabric_train.py --devices 4 --steps 20", tmp_path)
    assert fabric[1:] == ["examples/fabric_train.py", "--devices", "4", "--steps", "3"]
