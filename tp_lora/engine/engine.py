"""The engine built from a config and files, in one place: the model and its weights, the LoRA slots and adapter
registry, the runner, the sampler, wired into the step core (tp_lora.engine.core); generate() runs a list of requests
through the shared control loop (tp_lora.engine.control)."""
from __future__ import annotations

import os
from typing import Optional

import torch

from tp_lora import distributed as comm
from tp_lora.config import ConfigError, RunConfig, resolve_dtype, validate_for_model
from tp_lora.engine import control
from tp_lora.engine.adapters import AdapterRegistry, read_threads, usable_cores
from tp_lora.engine.core import EngineCore
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.runner import ModelRunner
from tp_lora.engine.sampler import Sampler
from tp_lora.engine.tokenizer import load_tokenizer
from tp_lora.lora.adapter import discover_adapters
from tp_lora.lora.cache import PREFETCH_DEPTH, AdapterCache, AdapterInfo
from tp_lora.lora.layers import LoRARuntime, module_shapes
from tp_lora.lora.slots import SlotTable
from tp_lora.models import registry as models
from tp_lora.models.checkpoint import CheckpointReader, load_hf_config
from tp_lora.models.loader import load_weights
from tp_lora.ops import get_backend

__all__ = ["Engine", "host_threads"]


def host_threads(requested: int, device_type: str) -> Optional[int]:
    """torch's host threads for one process (parallel.host_threads): `requested`, or for 0 one on CUDA, where the
    host only prepares steps and reads adapters, and None (torch's default) on CPU, where the model's compute runs on
    them."""
    if requested:
        return requested
    return 1 if device_type == "cuda" else None


class Engine(EngineCore):
    """The step core over the model in `model_dir` with the adapters found in `adapter_dir`, on this rank's share
    of the devices (`ps`)."""

    def __init__(self, cfg: RunConfig, ps: comm.ParallelState, model_dir: str, adapter_dir: Optional[str]):
        self.dtype = resolve_dtype(cfg.dtype, ps.device.type)
        self.hf = load_hf_config(model_dir)
        validate_for_model(self.hf, ps.tp.size)
        lo, p = cfg.lora, cfg.parallel
        if p.ep_size > 1 and self.hf.get("model_type") not in models.MOE_TYPES:
            raise ConfigError(f"parallel.ep_size={p.ep_size} splits experts, but model_type="
                              f"{self.hf.get('model_type')!r} has none (MoE types: {models.MOE_TYPES})")
        # The dtype of adapters read whole (a read by plan keeps the file's dtype and the slot image casts): fp8
        # quantizes B from the float32 original, others take the slots' dtype.
        host_dtype = torch.float32 if lo.dtype == "fp8" else self.dtype
        found = discover_adapters(adapter_dir) if adapter_dir else {}
        if adapter_dir and not found:
            raise ConfigError(f"lora.adapter_dir={adapter_dir} holds no adapter: expected adapter_config.json in it or "
                              "in its subdirectories (PEFT's save_pretrained layout); leave it unset for the base "
                              "model alone")
        cache = AdapterCache(found, lo.max_cpu_loras, host_dtype, ps.tp)
        cache.read_threads = read_threads(p.read_threads, ps.device.type, usable_cores(),
                                          int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        rt = None
        if cache.infos:
            ops = get_backend(lo.backend, str(ps.device))
            if hasattr(ops, "set_scheme"):
                ops.set_scheme(lo.kernel, lo.segment_size)
            rt = LoRARuntime(lo.max_loras, lo.max_rank, lo.fully_sharded, ops, fp8=lo.dtype == "fp8")
        targets = set().union(*(i.targets for i in cache.infos.values()))
        if not lo.lora_embeddings:
            targets -= {"embed_tokens", "lm_head"}
        comm.init_expert_parallel(ps, p.ep_size, p.ep_attention, p.timeout_s, p.allreduce)  # before the MoE blocks
        self.model = models.build(self.hf, ps.tp, self.dtype, ps.device, rt, targets, cfg.quantization,
                                  cfg.scheduler.kv_cache_dtype)
        load_weights(self.model, CheckpointReader(model_dir))
        slots = None
        if rt is not None:
            # Images alive at once: the host tier, the reads ahead, one being fetched.
            slots = SlotTable(rt, host_images=lo.max_cpu_loras + PREFETCH_DEPTH + 1)
            cache.attach_model(module_shapes(rt), lo.max_rank, slots)
        registry = AdapterRegistry(cache, slots, lo.max_loras, ps.device, ps.tp)
        # EP over DP replicas steps in lockstep with its peers (every rank of the EP group steps until all idle), and
        # holds every adapter in the same slot on every rank.
        lockstep = self.model.lockstep if getattr(self.model, "needs_lockstep", False) else None
        if rt is not None and lockstep is not None:
            registry.pin_all(lo.max_loras, p.ep_size)
        eos = self.hf.get("eos_token_id")
        self.tokenizer = load_tokenizer(model_dir)
        sampler = Sampler(cfg.generation, set(eos if isinstance(eos, list) else [eos] if eos is not None else []),
                          self.tokenizer, cfg.scheduler.max_batch_size)
        # MoE models say whether their decode step is free of host syncs (capturable) in their layout and dtype;
        # modules_to_save copies pick their slots' tokens on the host (not capturable).
        saved = any(getattr(m, "saved_table", None) is not None for m in self.model.modules())
        blocker = "modules_to_save pick their tokens on the host" if saved else getattr(self.model, "graph_blocker",
                                                                                          None)
        graphs = cfg.cuda_graphs and blocker is None
        if cfg.cuda_graphs and blocker is not None and ps.device.type == "cuda" and ps.rank == 0:
            print(f"cuda_graphs=true: steps run eagerly: {blocker}", flush=True)
        runner = ModelRunner(self.model, rt, ps.device, graphs, cfg.scheduler.max_tokens_per_step,
                             cfg.scheduler.max_batch_size)
        runner.vocab_shard = self.model.vocab_shard()  # plain rows drawn from each rank's logits shard
        super().__init__(cfg, ps, runner, registry, sampler, self.hf["vocab_size"],
                         self.hf.get("max_position_embeddings", 4096), lockstep)
        sizes = getattr(rt.ops, "warm_up_sizes", None) if rt is not None else None
        if sizes is not None and ps.device.type == "cuda" and lockstep is None:  # no solo steps in lockstep
            runner.warm_up([min(n, self.max_positions) for n in sizes(cfg.scheduler.max_tokens_per_step)],
                           cfg.scheduler.kv_block_size)
        # Set for serving, after the start-up's big host copies (weights, the image pool), which gain from threads.
        threads = host_threads(p.host_threads, ps.device.type)
        if threads is not None:
            torch.set_num_threads(threads)

    @property
    def adapters(self) -> dict[str, AdapterInfo]:
        """Usable adapters as registered (names, shapes); weights are read on first use."""
        return self.registry.infos

    @property
    def bad_adapters(self) -> dict[str, str]:
        """name -> why it cannot be used (found at start, or at its first read)."""
        return self.registry.bad

    def generate(self, requests: list[Request], on_result=lambda r: None, progress=lambda done, total: None,
                 **kw) -> list[Result]:
        """tp_lora.engine.control.generate over this engine."""
        return control.generate(self, requests, on_result, progress, **kw)

    def close(self) -> None:
        """Release CUDA graphs (call before the process group is destroyed), the adapter reader and the KV cache,
        whose memory goes back to the device: an engine or a process group made after this one finds it free."""
        self.runner.release_graphs()
        self.registry.close()
        self.kv = self.runner.cache = None
        self._pool = None  # its blocks indexed the cache
        if self.ps.device.type == "cuda":
            torch.cuda.empty_cache()
