"""The Python API: `LLM(model=..., adapter_dir=..., **overrides).generate(prompts, adapter=...)`.

One process, or under torchrun with every rank making the same calls (the ranks of a TP group run the model
together, data-parallel replicas split the prompts); the driver (global rank 0) gets the results. The offline app
(tp_lora.app) and the server (tp_lora.server) set up through LLM.from_config.
"""
from __future__ import annotations

import gc
import os
from typing import Any, Optional, Sequence, Union

from tp_lora import distributed as comm
from tp_lora.config import ConfigError, RunConfig, resolve_device, validate
from tp_lora.engine.requests import Request, Result, parse_stop, set_choices, set_rules

Prompt = Union[str, Sequence[int]]


def make_config(overrides: dict[str, Any]) -> RunConfig:
    """RunConfig from overrides as Hydra-style dotted keys ({"lora.max_loras": 8}) or nested values
    ({"lora": {"max_loras": 8}}), type-checked like the command line's."""
    from omegaconf import OmegaConf
    cfg = OmegaConf.structured(RunConfig)
    for key, value in overrides.items():
        try:
            OmegaConf.update(cfg, key, OmegaConf.create(value) if isinstance(value, dict) else value, merge=True)
        except Exception as e:  # omegaconf's errors name the key and the expected type
            raise ConfigError(f"override {key}={value!r}: {str(e).splitlines()[0]}") from None
    try:
        return OmegaConf.to_object(cfg)
    except Exception as e:
        raise ConfigError(f"overrides {overrides}: {str(e).splitlines()[0]}") from None


def resolve_model(cfg: RunConfig) -> tuple[str, Optional[str]]:
    """(model dir, adapter dir) the run reads: the embedded default (tiny Llama and its adapters) fills in what is
    not given."""
    default = None
    if cfg.model.path is None:
        from tp_lora.assets import ensure_default_assets
        default = ensure_default_assets()
    model_dir = cfg.model.path or default["model"]
    adapter_dir = cfg.lora.adapter_dir or (default["adapter_dir"] if default else None)
    for what, path in (("model.path", model_dir), ("lora.adapter_dir", adapter_dir)):
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"{what}={path!r} does not exist")
    return model_dir, adapter_dir


def check_expert_layout(cfg: RunConfig, model_dir: str) -> None:
    """Expert parallelism (parallel.ep_size > 1) needs an MoE model: said before any collective."""
    p = cfg.parallel
    if p.ep_size == 1:
        return
    from tp_lora.models.checkpoint import load_hf_config
    from tp_lora.models.registry import MOE_TYPES
    kind = load_hf_config(model_dir).get("model_type")
    if kind not in MOE_TYPES:
        raise ConfigError(f"parallel.ep_size={p.ep_size} (ep_attention={p.ep_attention}) splits MoE experts, but "
                          f"{model_dir} has model_type={kind!r}, not an MoE model ({', '.join(MOE_TYPES)}): use "
                          f"parallel.dp_size / tp_size for a dense model")


class LLM:
    """A model with its LoRA adapters on this process's share of the devices, ready to generate.

        llm = LLM()                                   # the embedded tiny default and its adapters alpha/beta/gamma
        llm = LLM(model="dir", adapter_dir="dir", **{"lora.max_loras": 8}, parallel={"tp_size": 2})
        out = llm.generate(["some text", [1, 17, 42]], adapter="alpha", max_new_tokens=16)
    """

    def __init__(self, model: Optional[str] = None, adapter_dir: Optional[str] = None, **overrides):
        cfg = make_config(overrides)
        if model is not None:
            cfg.model.path = model
        if adapter_dir is not None:
            cfg.lora.adapter_dir = adapter_dir
        self._start(cfg)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "LLM":
        self = cls.__new__(cls)
        self._start(cfg)
        return self

    def _start(self, cfg: RunConfig) -> None:
        # Everything that can be wrong with the config or files is found here, on every rank, before any
        # collective: a bad value ends every rank with the same message instead of leaving peers waiting.
        validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        device = resolve_device(cfg.device)
        self.cfg = cfg
        self.model_dir, self.adapter_dir = resolve_model(cfg)
        check_expert_layout(cfg, self.model_dir)
        self.ps = comm.init_parallel(cfg.parallel.tp_size, device, cfg.parallel.timeout_s, cfg.parallel.allreduce)
        from tp_lora.engine.engine import Engine
        self.engine = Engine(cfg, self.ps, self.model_dir, self.adapter_dir)
        self.tokenizer = self.engine.tokenizer

    @property
    def is_driver(self) -> bool:
        return self.ps.is_driver

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], adapter: Union[str, None, Sequence] = None,
                 max_new_tokens: Optional[int] = None, temperature: Optional[float] = None, *,
                 top_p: Optional[float] = None, seed: Optional[int] = None, stop=None,
                 ignore_eos: Optional[bool] = None, n: Optional[int] = None, best_of: Optional[int] = None,
                 **rules) -> Optional[list[dict]]:
        """Generate for one prompt or a list (text, or token ids). adapter: a name, None for the base model, or one
        per prompt. n: sequences per prompt (best_of: run that many, keep the n of highest cumulative log-probability;
        sibling i seeded seed + i). rules: logit rules (presence_penalty, frequency_penalty, repetition_penalty,
        logit_bias, min_tokens, stop_token_ids; tp_lora.engine.requests.RULES) and response_format. Returns on the
        driver one dict per prompt with the output lines' fields (id = the prompt's position; `choices` with n > 1 or
        best_of; `error` instead of outputs for a prompt that could not run), and None on the other ranks."""
        batch = self._batch(prompts)
        adapters = self._adapters(adapter, len(batch))
        requests = [self.request(i, i, p, adapters[i], max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos, n=n, best_of=best_of,
                                 **rules)
                    for i, p in enumerate(batch)]
        results = self.engine.generate(self.shard(requests))
        return self.gather(results)

    def score(self, prompts: Union[Prompt, Sequence[Prompt]], adapter: Union[str, None, Sequence] = None
              ) -> Optional[list[list[float]]]:
        """Score prompts (text or token ids) without generating: per prompt, the log-probability of each of its
        tokens after the ones before it (len - 1 values), under its adapter (a name, None for the base model, or one
        per prompt). Evaluation: perplexity, the likelihood of a continuation. Raises ValueError naming a prompt
        that cannot run, on every rank alike. Returns the list on the driver, None on the other ranks."""
        from tp_lora.engine.scoring import prompt_logprobs
        batch = self._batch(prompts)
        adapters = self._adapters(adapter, len(batch))
        requests = [self.request(i, i, p, adapters[i], max_new_tokens=1) for i, p in enumerate(batch)]
        for req in requests:  # every rank checks every prompt: a bad one stops all replicas alike
            err = self.engine.check_request(req, self.engine.max_positions)
            if err:
                raise ValueError(f"prompt {req.index}: {err}")
        mine, out = self.shard(requests), []
        group, names, tokens = [], set(), 0
        step = self.cfg.scheduler.max_tokens_per_step
        for req in mine + [None]:  # groups whose adapters fit in the slots at once and whose tokens fit a step
            fits = req is not None and len(names | {req.adapter} - {None}) <= self.cfg.lora.max_loras and \
                tokens + len(req.prompt_token_ids) <= step
            if group and not fits:
                out += zip(group, prompt_logprobs(self.engine, group))
                group, names, tokens = [], set(), 0
            if req is not None:
                group.append(req)
                names |= {req.adapter} - {None}
                tokens += len(req.prompt_token_ids)
        lines = [(r.index, lps) for r, lps in out]
        if self.ps.dp.size > 1:
            lines = [x for part in comm.all_gather_object(lines, self.ps.dp) for x in part]
        return [lps for _, lps in sorted(lines, key=lambda x: x[0])] if self.is_driver else None

    @staticmethod
    def _batch(prompts) -> list:
        return [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else list(prompts)

    @staticmethod
    def _adapters(adapter, n: int) -> list:
        adapters = list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * n
        if len(adapters) != n:
            raise ValueError(f"{len(adapters)} adapters for {n} prompts: give one, or one per prompt")
        return adapters

    def request(self, index: int, rid: Any, prompt: Prompt, adapter: Optional[str], *,
                max_new_tokens: Optional[int] = None, temperature: Optional[float] = None,
                top_p: Optional[float] = None, seed: Optional[int] = None, stop=None,
                ignore_eos: Optional[bool] = None, logprobs: int = 0, n: Optional[int] = None,
                best_of: Optional[int] = None, **rules) -> Request:
        """A Request from API values; a bad value gives a Request carrying `error` (reported, never raised)."""
        req = Request(index, id=rid, adapter=adapter, temperature=temperature, ignore_eos=ignore_eos, top_p=top_p,
                      seed=seed, logprobs=logprobs,
                      max_new_tokens=self.cfg.generation.max_new_tokens if max_new_tokens is None else max_new_tokens)
        try:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("a text prompt needs a tokenizer (tokenizer.json in the model dir); give token "
                                     "ids instead")
                req.prompt_token_ids = self.tokenizer.encode(prompt)
            elif all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                req.prompt_token_ids = list(prompt)
            else:
                raise ValueError(f"a prompt is a string or a list of token ids, got {prompt!r:.80}")
            if not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
                raise ValueError(f"max_new_tokens={req.max_new_tokens!r}: expected a positive integer")
            if temperature is not None and not temperature >= 0:
                raise ValueError(f"temperature={temperature!r}: expected >= 0")
            req.stop = parse_stop(stop)
            set_choices(req, n, best_of)
            set_rules(req, rules)
        except (ValueError, TypeError) as e:
            req.error = str(e)
        return req

    def shard(self, requests: list[Request]) -> list[Request]:
        """This data-parallel replica's share of the requests."""
        dp = self.ps.dp
        return [r for r in requests if r.index % dp.size == dp.rank]

    def gather(self, results: list[Result]) -> Optional[list[dict]]:
        """The replicas' results as output-line dicts in request order, on the driver; None elsewhere."""
        lines = [(r.request.index, r.to_json()) for r in results]
        if self.ps.dp.size > 1:
            lines = [x for part in comm.all_gather_object(lines, self.ps.dp) for x in part]
        return [ln for _, ln in sorted(lines, key=lambda x: x[0])] if self.is_driver else None

    def close(self) -> None:
        """Free the engine (CUDA graphs, adapter readers), then the process groups."""
        try:
            self.engine.close()
        finally:
            comm.shutdown()
            # The groups' last references go now, while the interpreter is whole: gloo's worker threads are then
            # joined here instead of being torn down during interpreter finalization (which aborts the process).
            self.engine = self.ps = self.tokenizer = None
            gc.collect()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
