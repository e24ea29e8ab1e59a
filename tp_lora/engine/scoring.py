"""Prompt scoring: the model's logits at every prompt position, each prompt with its adapter, in one step outside a
run (evaluation: perplexity, the log-probability of a continuation)."""
from __future__ import annotations

import torch

from tp_lora.engine.core import EngineCore
from tp_lora.engine.kv_pool import blocks_for
from tp_lora.engine.requests import Request
from tp_lora.engine.runner import StepBatch


@torch.no_grad()
def prompt_logits(engine: EngineCore, requests: list[Request]) -> list[torch.Tensor]:
    """Logits [len(prompt), V] at every prompt position of each request. All requests run in one step, so their
    adapters must fit in the slots at once; raises ValueError naming a request that cannot run."""
    if engine.sched is not None:
        raise RuntimeError("prompt scoring runs between runs, not while one is open")
    for req in requests:
        err = engine.check_request(req, engine.max_positions)
        if err:
            raise ValueError(err)
    names = list(dict.fromkeys(r.adapter for r in requests if r.adapter is not None))
    loaded = [n for n in names if engine.registry.state.slot_of(n) is None]
    slot_of = engine.registry.place(names)
    engine.stats.adapter_loads += len(loaded)
    bs = engine.cfg.scheduler.kv_block_size
    step, used = StepBatch(all_logits=True), 0
    for req in requests:
        n = blocks_for(len(req.prompt_token_ids), bs)
        step.add(list(req.prompt_token_ids), list(range(used, used + n)), 0, slot_of.get(req.adapter, -1))
        used += n
    cache = engine.runner.model.new_cache(used, bs)
    engine.registry.sync()
    return list(engine.runner.execute(step, cache).split([len(r.prompt_token_ids) for r in requests]))


def prompt_logprobs(engine: EngineCore, requests: list[Request]) -> list[list[float]]:
    """Per request, the log-probability of each prompt token after the ones before it (len(prompt) - 1 values)."""
    out = []
    for req, logits in zip(requests, prompt_logits(engine, requests)):
        ids = torch.tensor(req.prompt_token_ids[1:], device=logits.device)
        lps = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[:, None]).flatten()
        out.append(lps.tolist())
    return out
