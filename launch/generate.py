"""Multi-LoRA generation under torchrun + Hydra.

    python launch/generate.py                                   # embedded tiny model + adapters, one process
    torchrun --nproc_per_node=2 launch/generate.py parallel=tp2 lora.fully_sharded=true
    python launch/generate.py model.path=DIR lora.adapter_dir=DIR requests=in.jsonl output=out.jsonl
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from tp_lora.app import run  # noqa: E402
from tp_lora.config import RunConfig  # noqa: E402


@hydra.main(version_base=None, config_path="../configs", config_name="generate")
def main(cfg: DictConfig) -> None:
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))
    except Exception as e:  # omegaconf's validation errors name the key and the expected type
        print(f"[tp_lora] rank {os.environ.get('RANK', '0')}: config error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    code = run(typed)
    # The run has closed its output and torn down its process groups. Leaving through os._exit skips interpreter
    # teardown, where torch's C++ threads (gloo's, the rendezvous store's) are at times destroyed while still
    # joinable and abort a finished run ("terminate called without an active exception", exit -6).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
