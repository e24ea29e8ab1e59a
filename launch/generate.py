"""Multi-LoRA generation under torchrun + Hydra.

    python launch/generate.py                                   # embedded tiny model + adapters, one process
    python launch/generate.py parallel=tp2                      # starts its 2 ranks itself (one node)
    torchrun --nproc_per_node=2 launch/generate.py parallel=tp2 lora.fully_sharded=true
    python launch/generate.py model.path=DIR lora.adapter_dir=DIR requests=in.jsonl output=out.jsonl
"""
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from tp_lora.app import run  # noqa: E402
from tp_lora.lifecycle import hydra_job  # noqa: E402
from tp_lora.spawn import launch  # noqa: E402


@hydra.main(version_base=None, config_path="../configs", config_name="generate")
def main(cfg: DictConfig) -> None:
    hydra_job(cfg, partial(launch, job=run))  # without torchrun: the layout's ranks started here


if __name__ == "__main__":
    main()
