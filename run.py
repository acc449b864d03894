"""kvlab's entry point: compose the Hydra config, run one experiment (or a sweep with -m), exit non-zero if any run
failed.

    python run.py                                          # gpt2 size, prealloc cache, fp32, quick preset
    python run.py -m cache=concat,prealloc dtype=fp32,fp16 # a sweep: four runs, then a report in the sweep folder
"""

import sys

import hydra
from omegaconf import DictConfig

from harness.config import register
from harness.experiment import failed_runs, run

register()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    return run(cfg)


if __name__ == "__main__":
    main()
    sys.exit(1 if failed_runs() else 0)
