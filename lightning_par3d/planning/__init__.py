"""Which layout to train with: every layout par3d accepts for a model and a world, its memory and predicted step.

    from lightning_par3d.planning import plan, choose_layout, calibrate

    table = plan(GPTModule(), world_size=8, devices_per_node=8, device_memory="80GiB",
                 global_batch=16, seq_len=64, machine="h100-sxm-8")
    print(table)                      # fitting layouts fastest first, then the rejected ones with their reasons
    config = choose_layout(GPTModule(), 8, 8, "80GiB", global_batch=16, seq_len=64)   # the best, a Par3DConfig

``par3d plan --model-config conf/model/gpt.yaml --world-size 8 ...`` prints the same table
(:mod:`lightning_par3d.tools.plan`).

* :mod:`~lightning_par3d.planning.candidates`: the search space, ``fixed``, and the checks before the model;
* :mod:`~lightning_par3d.planning.probe`: FLOPs, ops, tp collectives and shapes, read from the model;
* :mod:`~lightning_par3d.planning.candidate_memory`: each layout's memory, the estimator's figures;
* :mod:`~lightning_par3d.planning.schedule_timing`: torch's pipeline order, timed;
* :mod:`~lightning_par3d.planning.cost`: the step-time formulas;
* :mod:`~lightning_par3d.planning.machine`: machines, links and profiles (with their sources);
* :mod:`~lightning_par3d.planning.calibrate`: measuring this machine;
* :mod:`~lightning_par3d.planning.table`, :mod:`~lightning_par3d.planning.plot`: the result, as text and picture.
"""

from lightning_par3d.planning.calibrate import calibrate
from lightning_par3d.planning.candidates import SearchSpace
from lightning_par3d.planning.cost import StepTime, predict_step
from lightning_par3d.planning.machine import PROFILES, Link, Machine, machine_profile
from lightning_par3d.planning.planner import choose_layout, plan
from lightning_par3d.planning.plot import plot
from lightning_par3d.planning.schedule_timing import schedule_bubble
from lightning_par3d.planning.table import PlanRow, PlanTable

__all__ = [
    "PROFILES",
    "Link",
    "Machine",
    "PlanRow",
    "PlanTable",
    "SearchSpace",
    "StepTime",
    "calibrate",
    "choose_layout",
    "machine_profile",
    "plan",
    "plot",
    "predict_step",
    "schedule_bubble",
]
