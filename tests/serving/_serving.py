"""Helpers of the serving tests: more adapters than any test's slots or host cache (mixed ranks and targets),
requests over them, configs, and running the app the way users do."""
import json
import os
import subprocess
import sys

import torch

from tp_lora.assets import write_random_adapter, write_tiny_llama
from tp_lora.config import RunConfig
from tp_lora.engine.requests import Request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "launch", "generate.py")
ADAPTERS = {  # name -> write_random_adapter kwargs
    "r8": dict(r=8, lora_alpha=16),
    "r4": dict(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj")),
    "r16": dict(r=16, lora_alpha=16, rank_pattern={"o_proj": 4}),
    "rs": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=("gate_proj", "up_proj")),
    "emb": dict(r=8, lora_alpha=16, include_embedding=True, include_lm_head=True),
    "a5": dict(r=4, lora_alpha=4),
    "a6": dict(r=8, lora_alpha=32, target_modules=("k_proj", "o_proj")),
    "a7": dict(r=16, lora_alpha=8),
    "a8": dict(r=2, lora_alpha=4),
    "a9": dict(r=8, lora_alpha=16, target_modules=("up_proj",)),
}


def make_requests(n: int, seed: int = 0, adapters=tuple(ADAPTERS) + (None,), new=(2, 8), prompt=(1, 20)):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        a = adapters[int(torch.randint(0, len(adapters), (), generator=gen))]
        p = int(torch.randint(prompt[0], prompt[1] + 1, (), generator=gen))
        m = int(torch.randint(new[0], new[1] + 1, (), generator=gen))
        out.append(Request(i, id=f"q{i}", adapter=a, prompt_token_ids=torch.randint(3, 256, (p,), generator=gen)
                           .tolist(), max_new_tokens=m, ignore_eos=True))
    return out


def serving_cfg(tp: int = 1, max_loras: int = 2, max_cpu_loras: int = 3, batch: int = 6, budget: int = 16,
                **scheduler) -> RunConfig:
    cfg = RunConfig()
    cfg.parallel.tp_size = tp
    cfg.device, cfg.dtype, cfg.cuda_graphs, cfg.progress = "cpu", "float32", False, False
    cfg.lora.max_loras, cfg.lora.max_cpu_loras, cfg.lora.max_rank = max_loras, max_cpu_loras, 16
    cfg.scheduler.max_batch_size, cfg.scheduler.max_tokens_per_step = batch, budget
    for k, v in scheduler.items():
        setattr(cfg.scheduler, k, v)
    return cfg


def write_requests(path, requests) -> str:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"id": r.id, "adapter": r.adapter, "prompt_token_ids": r.prompt_token_ids,
                                "max_new_tokens": r.max_new_tokens, "ignore_eos": True}) + "\n")
    return str(path)


def launch_cmd(args, nproc: int = 1, port: int | None = None):
    from tp_lora.testing import listen_port
    if nproc == 1:
        return [sys.executable, SCRIPT] + list(args)
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={port or listen_port()}", SCRIPT] + list(args)


def run_app(args, nproc: int = 1, timeout: float = 120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(launch_cmd(args, nproc), capture_output=True, text=True, timeout=timeout, env=env)


def read_lines(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(x) for x in f.read().splitlines()]
