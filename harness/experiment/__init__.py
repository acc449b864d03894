"""The run layer: a Hydra config in, one run's folder out (results.json, its tables, run.log, W&B).

    from harness.experiment import run          # run(cfg): what run.py calls for each run of a sweep

It reads Hydra once, at the door (``config``: the typed nodes, ``read`` into the run's plain ``RunConfig``,
validation), plans the run (``plan``: the ``RunConfig`` and the ``Plan`` it resolves to; below the door nothing sees
the DictConfig), resolves the weights (``weights``), checks memory (``memory``), prepares and measures
(``prepare``: plan, load, measure, each measurement reached through the registry's hooks), takes the folder and
resumes (``folder``), writes the record (``describe``, ``tracking``), sequences all of it (``runner``) and keeps an
invocation's runs together (``invocation``, ``slurm_check``, ``slurm_jobs``). It owns results.json: writing it and reading it back. Nothing here imports the analysis layer,
training or the tools.
"""


def run(cfg, progress: bool = True) -> dict:
    """One run from its Hydra config (``harness.experiment.runner.run``); imported on call, so that the modules of
    this package that read and write files (record, tracking) load without torch."""
    from harness.experiment.runner import run as run_

    return run_(cfg, progress)
