"""Process groups and what runs over them: the default group and the meshes (``groups``, ``mesh``), where the
ranks sit on nodes (``locality``), CPU threads per rank (``threads``), gathering and metric sync (``gather``,
``metric_sync``), the global gradient norm (``gradients``), a failing job's message (``faults``), and the fake
world the estimator and the planner simulate ranks in (``fakeworld``)."""
