"""The generation engine: a model with its LoRA slots and KV cache, a scheduler over the requests, the step loop.

Every rank of a TP group runs this same deterministic loop on the same requests, so they agree on every batch
without exchanging control messages; only the model's collectives cross ranks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from tp_lora import distributed as comm
from tp_lora.config import ConfigError, RunConfig, resolve_device, resolve_dtype, validate_for_model
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.runner import ModelRunner, StepBatch
from tp_lora.engine.sampler import sample
from tp_lora.lora.adapter import AdapterError, LoRAAdapter, discover_adapters, load_peft_adapter, validate_adapter
from tp_lora.lora.layers import LoRARuntime, module_shapes
from tp_lora.lora.slots import SlotTable
from tp_lora.models.checkpoint import CheckpointReader, load_hf_config
from tp_lora.models.llama import CausalLM
from tp_lora.models.loader import load_weights
from tp_lora.models.registry import MOE_TYPES
from tp_lora.ops import get_backend


@dataclass
class Sequence:
    request: Request
    row: int  # KV-cache row
    slot: int  # adapter slot, -1 for none
    tokens: list[int]
    prompt_len: int
    computed: int = 0  # tokens already in the KV cache
    result: Result = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class StepStats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    adapter_loads: int = 0
    extra: dict = field(default_factory=dict)


def build_model(hf: dict, tp: comm.Group, dtype, device, rt: Optional[LoRARuntime], targets: Optional[set]):
    """The model class for a config.json: MoE configs go to tp_lora.models.moe, the rest are Llama-family."""
    from tp_lora.models import registry
    return registry.build(hf, tp, dtype, device, rt, targets)


class Engine:
    def __init__(self, cfg: RunConfig, ps: comm.ParallelState, model_dir: str, adapter_dir: Optional[str]):
        self.cfg, self.ps = cfg, ps
        self.device = str(ps.device)
        dev_kind = resolve_device(cfg.device) if cfg.device != "auto" else ps.device.type
        self.dtype = resolve_dtype(cfg.dtype, dev_kind)
        self.hf = load_hf_config(model_dir)
        validate_for_model(self.hf, ps.tp.size)
        self.adapter_paths = discover_adapters(adapter_dir) if adapter_dir else {}
        self.adapters: dict[str, LoRAAdapter] = {}
        self.bad_adapters: dict[str, str] = {}
        self._read_adapters()
        lo = cfg.lora
        self.rt = None
        if self.adapters:
            ops = get_backend(lo.backend, self.device)
            if hasattr(ops, "set_scheme"):
                ops.set_scheme(lo.kernel, lo.segment_size)
            self.rt = LoRARuntime(lo.max_loras, lo.max_rank, lo.fully_sharded, ops, fp8=lo.dtype == "fp8")
        targets = {p.rsplit(".", 1)[-1] for a in self.adapters.values() for p in a.modules}
        if not lo.lora_embeddings:
            targets -= {"embed_tokens", "lm_head"}
        p = cfg.parallel
        if p.ep_size > 1 and self.hf.get("model_type") not in MOE_TYPES:
            raise ConfigError(f"parallel.ep_size={p.ep_size} splits experts, but model_type="
                              f"{self.hf.get('model_type')!r} has none (MoE types: {MOE_TYPES})")
        comm.init_expert_parallel(ps, p.ep_size, p.ep_attention, p.timeout_s)  # before the MoE blocks are built
        self.model = build_model(self.hf, ps.tp, self.dtype, ps.device, self.rt, targets)
        load_weights(self.model, CheckpointReader(model_dir))
        if self.rt is not None:
            self._validate_adapters()
            self.slots = SlotTable(self.rt)
            if getattr(self.model, "needs_lockstep", False):
                self._pin_adapters()
        eos = self.hf.get("eos_token_id")
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.max_positions = self.hf.get("max_position_embeddings", 4096)
        # MoE routing reads expert counts on the host every layer: not capturable in a CUDA graph.
        moe = self.hf.get("model_type") in MOE_TYPES
        self.runner = ModelRunner(self.model, self.rt, ps.device, cfg.cuda_graphs and not moe)
        self.generator = torch.Generator().manual_seed(cfg.generation.seed)
        self.stats = StepStats()

    # ---- adapters -------------------------------------------------------------------------------------------
    def _read_adapters(self) -> None:
        for name, path in self.adapter_paths.items():
            try:
                self.adapters[name] = load_peft_adapter(path, name=name)  # + PEFT target_parameters (MoE)
            except (AdapterError, ValueError, OSError) as e:
                self.bad_adapters[name] = str(e)

    def _pin_adapters(self) -> None:
        """Expert parallelism over DP replicas sends a token's adapter slot to the rank owning its expert, so every
        rank must hold every adapter in the same slot: load them all once, in name order."""
        names = sorted(self.adapters)
        if len(names) > self.cfg.lora.max_loras:
            raise ConfigError(f"parallel.ep_attention=dp with ep_size={self.cfg.parallel.ep_size} pins every adapter "
                              f"in a slot, but there are {len(names)} adapters for lora.max_loras="
                              f"{self.cfg.lora.max_loras}: raise lora.max_loras")
        for slot, name in enumerate(names):
            self.slots.load(slot, self.adapters[name])

    def _validate_adapters(self) -> None:
        shapes = module_shapes(self.rt)
        for name in list(self.adapters):
            try:
                validate_adapter(self.adapters[name], shapes, self.cfg.lora.max_rank)
            except (AdapterError, ValueError) as e:
                self.bad_adapters[name] = str(e)
                del self.adapters[name]

    def check_request(self, req: Request, max_len: int) -> Optional[str]:
        """Why this request cannot run, or None."""
        if req.error:
            return req.error
        if req.adapter is not None:
            if req.adapter in self.bad_adapters:
                return f"adapter {req.adapter!r} failed to load: {self.bad_adapters[req.adapter]}"
            if req.adapter not in self.adapters:
                known = sorted(self.adapters) or "none (set lora.adapter_dir)"
                return f"unknown adapter {req.adapter!r}; known adapters: {known}"
        vocab = self.hf["vocab_size"]
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            return f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
        total = len(req.prompt_token_ids) + req.max_new_tokens
        if total > max_len:
            return (f"prompt ({len(req.prompt_token_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) = {total} "
                    f"exceeds the context of {max_len} tokens")
        return None

    def _step(self, work: list[tuple[Sequence, int]], cache) -> torch.Tensor:
        """work: (sequence, number of its new tokens). Returns logits [N, V] of each sequence's last new token."""
        step = StepBatch()
        for seq, n in work:
            step.add(seq.tokens[seq.computed:seq.computed + n], seq.row, seq.computed, seq.slot)
        logits = self.runner.execute(step, cache)
        for seq, n in work:
            seq.computed += n
        return logits

    @torch.no_grad()
    def prompt_logits(self, requests: list[Request]) -> list[torch.Tensor]:
        """Logits [len(prompt), V] at every prompt position of each request, each with its adapter, in one step
        (evaluation and scoring; all requests must fit in the slots at once)."""
        for req in requests:
            err = self.check_request(req, self.max_positions)
            if err:
                raise ValueError(err)
        seqs = []
        for row, req in enumerate(requests):
            slot = self._slot_for(req.adapter, seqs)
            if slot is None:
                raise ValueError(f"{len({r.adapter for r in requests})} adapters do not fit in "
                                 f"lora.max_loras={self.cfg.lora.max_loras} slots")
            seqs.append(Sequence(req, row, slot, list(req.prompt_token_ids), len(req.prompt_token_ids)))
        cache = self.model.new_cache(len(seqs), max(s.prompt_len for s in seqs))
        step = StepBatch(all_logits=True)
        for s in seqs:
            step.add(s.tokens, s.row, 0, s.slot)
        return list(self.runner.execute(step, cache).split([s.prompt_len for s in seqs]))

    # ---- scheduling ---------------------------------------------------------------------------------------
    def _slot_for(self, name: Optional[str], running: list[Sequence]) -> Optional[int]:
        """The slot holding adapter `name`, loading it into a slot no running sequence uses; None if all busy."""
        if name is None:
            return -1
        slot = self.slots.slot_of(name)
        if slot is not None:
            return slot
        busy = {s.slot for s in running}
        free = [i for i, n in enumerate(self.slots.names) if i not in busy]
        if not free:
            return None
        empty = [i for i in free if self.slots.names[i] is None]
        slot = empty[0] if empty else free[0]
        self.slots.load(slot, self.adapters[name])
        self.stats.adapter_loads += 1
        return slot

    @torch.no_grad()
    def generate(self, requests: list[Request], on_result: Callable[[Result], None] = lambda r: None,
                 progress: Callable[[int, int], None] = lambda done, total: None) -> list[Result]:
        """Continuous batching: admit waiting requests first-come-first-served as rows and slots free up, mix
        prefill and decode in one step, retire finished sequences at once."""
        cfg = self.cfg
        results: dict[int, Result] = {}
        max_len = self.cfg.model.max_seq_len or self.max_positions
        waiting: list[Request] = []
        for req in requests:
            err = self.check_request(req, max_len)
            if err:
                results[req.index] = Result(req, error=err)
                on_result(results[req.index])
            else:
                waiting.append(req)
        # EP over DP replicas: every rank of the EP group steps until all are idle (a rank out of work still serves
        # the others' tokens routed to its experts).
        lockstep = self.model.lockstep if getattr(self.model, "needs_lockstep", False) else None
        if not waiting:
            while lockstep is not None and lockstep(0):
                pass
            return [results[r.index] for r in requests]
        cache_len = min(max_len, max(len(r.prompt_token_ids) + r.max_new_tokens for r in waiting))
        rows_total = min(cfg.scheduler.max_batch_size, len(waiting))
        cache = self.runner.kv_cache(rows_total, cache_len)
        free_rows = list(range(rows_total))
        running: list[Sequence] = []
        t0 = time.perf_counter()
        while waiting or running:
            budget = cfg.scheduler.max_tokens_per_step
            work = []
            for seq in running:  # decode first: one token each, and the rest of chunked prompts
                n = min(len(seq.tokens) - seq.computed, budget) if seq.computed < seq.prompt_len else 1
                if n > 0:
                    work.append((seq, n))
                    budget -= n
            while waiting and free_rows and budget > 0:
                req = waiting[0]
                slot = self._slot_for(req.adapter, running)
                if slot is None:
                    break  # FCFS: the head waits for a slot; nobody overtakes it, so it cannot starve
                waiting.pop(0)
                seq = Sequence(req, free_rows.pop(0), slot, list(req.prompt_token_ids), len(req.prompt_token_ids),
                               result=Result(req))
                running.append(seq)
                n = min(seq.prompt_len, budget)
                work.append((seq, n))
                budget -= n
                self.stats.prompt_tokens += seq.prompt_len
            if lockstep is not None:
                lockstep(sum(n for _, n in work))
            logits = self._step(work, cache)
            sampled = [(seq, i) for i, (seq, _) in enumerate(work) if seq.computed == len(seq.tokens)]
            if sampled:
                temps = [self._temperature(s.request) for s, _ in sampled]
                toks, lps = sample(logits[[i for _, i in sampled]], temps, cfg.generation.top_p, self.generator)
                for (seq, _), tok, lp in zip(sampled, toks, lps):
                    seq.tokens.append(tok)
                    seq.result.output_token_ids.append(tok)
                    seq.result.logprobs.append(lp)
                    self.stats.generated_tokens += 1
                    if self._finished(seq, tok):
                        running.remove(seq)
                        free_rows.append(seq.row)
                        results[seq.request.index] = seq.result
                        on_result(seq.result)
                        progress(len(results), len(requests))
            self.stats.steps += 1
        while lockstep is not None and lockstep(0):
            pass
        self.stats.seconds += time.perf_counter() - t0
        return [results[r.index] for r in requests]

    def close(self) -> None:
        """Release CUDA graphs; call before the process group is destroyed."""
        self.runner.release_graphs()

    def _temperature(self, req: Request) -> float:
        return req.temperature if req.temperature is not None else self.cfg.generation.temperature

    def _finished(self, seq: Sequence, tok: int) -> bool:
        ignore = seq.request.ignore_eos if seq.request.ignore_eos is not None else self.cfg.generation.ignore_eos
        if not ignore and tok in self.eos:
            seq.result.finish_reason = "stop"
            return True
        return seq.generated >= seq.request.max_new_tokens
