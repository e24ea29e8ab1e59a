"""An OpenAI-compatible server (tp_lora.server) under Hydra: global rank 0 serves HTTP, every rank steps.

    python launch/serve.py                                      # embedded tiny model + adapters on 127.0.0.1:8000
    python launch/serve.py parallel=dp2_tp2                     # starts its 4 ranks itself (one node)
    torchrun --nproc_per_node=2 launch/serve.py parallel=tp2 server.port=8001
    python launch/serve.py model.path=DIR lora.adapter_dir=DIR server.api_key=KEY
"""
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from tp_lora.lifecycle import hydra_job  # noqa: E402
from tp_lora.spawn import launch  # noqa: E402
from tp_lora.server.serve import run  # noqa: E402


@hydra.main(version_base=None, config_path="../configs", config_name="serve")
def main(cfg: DictConfig) -> None:
    hydra_job(cfg, partial(launch, job=run))  # without torchrun: the layout's ranks started here


if __name__ == "__main__":
    main()
