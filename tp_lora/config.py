"""Typed run configuration (the schema behind the Hydra configs) and its validation.

`validate()` checks the values alone; `validate_for_model()` checks them against the checkpoint's config.json.
Both run on every rank before any collective, so a bad config ends every rank with the same message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


class ConfigError(ValueError):
    pass


@dataclass
class ModelConfig:
    path: Optional[str] = None  # HF model dir; None = the embedded tiny default (written on first use)
    max_seq_len: Optional[int] = None  # KV cache length; None = prompt + max_new_tokens of the longest request


@dataclass
class ParallelConfig:
    tp_size: int = 1
    # Ranks beyond tp_size form data-parallel replicas (each serves its share of the requests).
    # Data-parallel replicas to start when launched without torchrun (python launch/serve.py parallel=dp2 starts
    # dp_size x tp_size ranks itself); null = one. Under torchrun the launched ranks decide (it must then agree).
    dp_size: Optional[int] = None
    timeout_s: float = 300.0  # a collective that does not complete in this time fails the run
    # The tp group's all-reduce: auto (symm_mem where the group's GPUs share one host with P2P access, else nccl) |
    # nccl (NCCL on CUDA, gloo on CPU) | symm_mem (PyTorch symmetric memory over NVLink peer memory for messages up
    # to 8 MiB, NCCL above; an error without P2P). The choice is printed at start.
    allreduce: str = "auto"
    # MoE models: experts split over ep_size ranks (1 = every rank holds every expert, intermediate split over tp).
    ep_size: int = 1
    # Where the expert-parallel group's tokens come from: dp = EP ranks are DP replicas, each with its own requests
    # (with tp_size > 1 an ep x tp 2D mesh: experts over ep, each expert's intermediate over tp); tp = the EP group
    # is the attention TP group (ep_size == tp_size) and each rank routes a 1/tp chunk of the replicated tokens.
    ep_attention: str = "dp"
    # torch's host threads per process: 0 = one on CUDA (the host only prepares steps and reads adapters, as under
    # torchrun's OMP_NUM_THREADS=1), torch's default on CPU (the model computes on them).
    host_threads: int = 0
    # Threads for an adapter read the step loop waits on (its file read in pieces; torch's, for its screen and
    # copies), and for a read ahead of need that starts while the step loop waits for reads; other reads ahead run
    # on one beside the steps. 0 = on CUDA the rank's share of the host's cores less one (at most 8), on CPU one for
    # the file and torch's own for the rest.
    read_threads: int = 0


@dataclass
class LoRAConfig:
    adapter_dir: Optional[str] = None  # every subdirectory with adapter_config.json is an adapter
    max_loras: int = 4  # device slots
    # Host tier of the adapter cache: adapters read from disk and kept in host memory, least recently used
    # evicted. Every adapter under adapter_dir is registered at start from its config and safetensors header only.
    max_cpu_loras: int = 64
    max_rank: int = 16
    fully_sharded: bool = False
    backend: str = "auto"  # auto | torch | triton
    kernel: str = "chunked"  # chunked | sorted (triton scheduling scheme)
    segment_size: Optional[int] = None  # tokens per segment for kernel=chunked; None = chosen per step
    # auto (the model's) | fp8: B stored as float8_e4m3 with per-channel scales (attention, dense MLP and MoE
    # expert layers)
    dtype: str = "auto"
    lora_embeddings: bool = True  # also wrap embed_tokens / lm_head (only when an adapter targets them)


@dataclass
class GenerationConfig:
    max_new_tokens: int = 16  # for requests that do not say
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False


@dataclass
class SchedulerConfig:
    max_batch_size: int = 32  # sequences per step
    max_tokens_per_step: int = 4096  # tokens per step: one per decoding sequence + prefill chunks
    # KV cache (blocks of kv_block_size positions, taken by sequences as they grow) sized from the memory left after
    # weights and adapter slots: on CUDA this fraction of torch.cuda.mem_get_info's free bytes; kv_cache_mb caps it
    # (and is the size on CPU). A run allocates no more than its requests can use at once, but on CUDA with
    # prefix_caching the whole budget (the prefix cache keeps what the running requests leave).
    kv_memory_fraction: float = 0.8
    kv_cache_mb: Optional[float] = None  # None: no cap on CUDA, 1024 MiB on CPU
    kv_block_size: int = 16
    # auto: the model's dtype | fp8: float8_e4m3 K and V (half the bytes of bf16 per position), scale 1 per tensor
    # (stored values saturate at +-448); README "FP8".
    kv_cache_dtype: str = "auto"
    # Keep the full KV blocks of finished and preempted sequences, and let a new request of the same adapter reuse the
    # longest cached prefix of its prompt instead of computing it (evicted least recently used, only when needed).
    prefix_caching: bool = True
    # A request blocked on adapter slots may be overtaken by later requests whose adapter is resident at most this
    # many times; then nothing passes it until it is admitted (no starvation).
    max_overtakes: int = 16
    # Cached prefixes first: when a step's token budget cannot start every waiting prefill, waiting requests with a
    # longer prefix in the prefix cache are admitted first (their prefill is short: a hit's time to first token).
    # A request passed over in this many steps is then admitted first (no starvation); 0 = arrival order.
    max_prefix_overtakes: int = 8
    # While sequences decode, admit only when this many waiting requests (or all of them, if fewer; at most
    # max_batch_size) fit at once: every admission makes its step mix prefill and decode, a costlier step than a
    # decode-only one. 1 = admit as soon as any room frees (the default's measurements: BENCHMARKS.md).
    admit_batch: int = 8
    # Ctrl-C / SIGTERM: stop admitting, finish in-flight sequences for up to this long, then abandon them
    # (a second signal abandons at once). The ranks agree on stopping every stop_check_steps steps.
    stop_grace_s: float = 20.0
    stop_check_steps: int = 8


@dataclass
class ServerConfig:
    """launch/serve.py's HTTP front end (rank 0)."""
    host: str = "127.0.0.1"  # 0.0.0.0 to listen on every interface
    port: int = 8000
    # Requests admitted beyond the running batch (scheduler.max_batch_size) before new ones get 429 + Retry-After.
    max_queue: int = 256
    api_key: Optional[str] = None  # when set, /v1/* need "Authorization: Bearer <api_key>"
    model_name: Optional[str] = None  # the base model's name in the API; None = the model dir's name
    # Data-parallel replicas: which one serves a request (tp_lora.server.router). affinity: one holding its adapter
    # in a device slot, else in host memory, else the least loaded; least_loaded; round_robin.
    routing: str = "affinity"
    # affinity: requests a replica may queue beyond its batch (scheduler.max_batch_size) past the least queued
    # replica before a request goes elsewhere than to its adapter's replica.
    max_imbalance: int = 4
    # Client input bounds (README "Security"): a body past max_body_mb is a 413, read no further; bodies being read
    # at once hold at most max_reading_mb (beyond: 503 + Retry-After); a body must arrive within body_timeout_s and a
    # request's headers within header_timeout_s (408 / connection closed); at most max_connections open at once.
    max_body_mb: float = 16.0
    max_reading_mb: float = 256.0
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    max_connections: int = 1024
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter: off unless allowed; a lora_path must resolve (links and
    # `..` followed) inside one of lora_roots (null = [lora.adapter_dir]).
    allow_runtime_lora: bool = False
    lora_roots: Optional[list[str]] = None


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)  # launch/serve.py only
    requests: Optional[str] = None  # JSONL; None = the embedded default requests
    output: str = "outputs.jsonl"
    resume: bool = False  # keep the lines already in `output` and run only the requests they do not answer
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (float32 on cpu, bfloat16 on cuda) | float32 | float16 | bfloat16
    # null | fp8: quantize a 16/32-bit checkpoint's linear layers to float8_e4m3 at load (per output channel). FP8
    # checkpoints (quantization_config in config.json) load as fp8 either way. README "FP8".
    quantization: Optional[str] = None
    cuda_graphs: bool = True
    progress: bool = True


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate(cfg: RunConfig, world_size: int = 1) -> None:
    """Value checks that need no checkpoint."""
    p, lo = cfg.parallel, cfg.lora
    _check(p.tp_size >= 1, f"parallel.tp_size={p.tp_size}: expected >= 1")
    _check(world_size % p.tp_size == 0,
           f"parallel.tp_size={p.tp_size} does not divide the {world_size} launched processes")
    _check(p.dp_size is None or p.dp_size >= 1, f"parallel.dp_size={p.dp_size}: expected null or >= 1")
    _check(p.dp_size is None or world_size in (1, p.dp_size * p.tp_size),
           f"parallel.dp_size={p.dp_size} x parallel.tp_size={p.tp_size} = {(p.dp_size or 1) * p.tp_size} ranks, "
           f"but {world_size} were launched")
    _check(p.timeout_s > 0, f"parallel.timeout_s={p.timeout_s}: expected > 0")
    _check(p.allreduce in ("auto", "nccl", "symm_mem"),
           f"parallel.allreduce={p.allreduce!r}: expected auto, nccl or symm_mem")
    _check(p.allreduce != "symm_mem" or cfg.device != "cpu",
           "parallel.allreduce=symm_mem reduces over GPU peer memory, but device=cpu: use auto or nccl")
    _check(p.host_threads >= 0, f"parallel.host_threads={p.host_threads}: expected >= 0 (0 = automatic)")
    _check(p.read_threads >= 0, f"parallel.read_threads={p.read_threads}: expected >= 0 (0 = automatic)")
    _check(p.ep_size >= 1, f"parallel.ep_size={p.ep_size}: expected >= 1")
    _check(p.ep_attention in ("dp", "tp"), f"parallel.ep_attention={p.ep_attention!r}: expected dp or tp")
    if p.ep_size > 1 and p.ep_attention == "tp":
        _check(p.ep_size == p.tp_size, f"parallel.ep_attention=tp splits the experts over the attention TP group: "
                                       f"parallel.ep_size={p.ep_size} must equal parallel.tp_size={p.tp_size}")
    if p.ep_size > 1 and p.ep_attention == "dp" and world_size % p.tp_size == 0:
        replicas = world_size // p.tp_size
        _check(replicas % p.ep_size == 0,
               f"parallel.ep_size={p.ep_size} must divide the {replicas} data-parallel replicas ({world_size} "
               f"processes / parallel.tp_size={p.tp_size}) when parallel.ep_attention=dp")
    _check(lo.max_loras >= 1, f"lora.max_loras={lo.max_loras}: expected >= 1")
    _check(lo.max_rank >= 1, f"lora.max_rank={lo.max_rank}: expected >= 1")
    _check(lo.max_cpu_loras >= 1, f"lora.max_cpu_loras={lo.max_cpu_loras}: expected >= 1")
    _check(lo.backend in ("auto", "torch", "triton"), f"lora.backend={lo.backend!r}: expected auto, torch or triton")
    _check(lo.kernel in ("sorted", "chunked"), f"lora.kernel={lo.kernel!r}: expected sorted or chunked")
    _check(lo.segment_size is None or (lo.segment_size >= 16 and lo.segment_size & (lo.segment_size - 1) == 0),
           f"lora.segment_size={lo.segment_size}: expected null or a power of two >= 16")
    _check(lo.dtype in ("auto", "fp8"), f"lora.dtype={lo.dtype!r}: expected auto or fp8")
    if lo.fully_sharded:
        _check(lo.max_rank % p.tp_size == 0,
               f"lora.fully_sharded=true splits the rank dim: lora.max_rank={lo.max_rank} must be divisible by "
               f"parallel.tp_size={p.tp_size}")
    _check(cfg.device in ("auto", "cpu", "cuda"), f"device={cfg.device!r}: expected auto, cpu or cuda")
    _check(cfg.quantization in (None, "fp8"), f"quantization={cfg.quantization!r}: expected null or fp8")
    _check(cfg.dtype in ("auto", "float32", "float16", "bfloat16"),
           f"dtype={cfg.dtype!r}: expected auto, float32, float16 or bfloat16")
    g = cfg.generation
    _check(g.max_new_tokens >= 1, f"generation.max_new_tokens={g.max_new_tokens}: expected >= 1")
    _check(g.temperature >= 0, f"generation.temperature={g.temperature}: expected >= 0")
    _check(0 < g.top_p <= 1, f"generation.top_p={g.top_p}: expected in (0, 1]")
    s = cfg.scheduler
    _check(s.max_batch_size >= 1, f"scheduler.max_batch_size={s.max_batch_size}: expected >= 1")
    _check(s.max_tokens_per_step >= s.max_batch_size,
           f"scheduler.max_tokens_per_step={s.max_tokens_per_step}: expected >= scheduler.max_batch_size="
           f"{s.max_batch_size} (every running sequence decodes one token per step)")
    _check(0 < s.kv_memory_fraction <= 1, f"scheduler.kv_memory_fraction={s.kv_memory_fraction}: expected in (0, 1]")
    _check(s.kv_cache_mb is None or s.kv_cache_mb > 0, f"scheduler.kv_cache_mb={s.kv_cache_mb}: expected null or > 0")
    _check(s.kv_cache_dtype in ("auto", "fp8"), f"scheduler.kv_cache_dtype={s.kv_cache_dtype!r}: expected auto or fp8")
    _check(s.kv_block_size >= 1, f"scheduler.kv_block_size={s.kv_block_size}: expected >= 1")
    _check(s.max_overtakes >= 0, f"scheduler.max_overtakes={s.max_overtakes}: expected >= 0")
    _check(s.max_prefix_overtakes >= 0, f"scheduler.max_prefix_overtakes={s.max_prefix_overtakes}: expected >= 0")
    _check(s.admit_batch >= 1, f"scheduler.admit_batch={s.admit_batch}: expected >= 1")
    _check(s.stop_grace_s >= 0, f"scheduler.stop_grace_s={s.stop_grace_s}: expected >= 0")
    _check(s.stop_check_steps >= 1, f"scheduler.stop_check_steps={s.stop_check_steps}: expected >= 1")
    v = cfg.server
    _check(0 <= v.port <= 65535, f"server.port={v.port}: expected 0..65535 (0 = any free port)")
    _check(v.max_queue >= 0, f"server.max_queue={v.max_queue}: expected >= 0")
    _check(v.api_key is None or bool(v.api_key), "server.api_key is empty: give a key or null")
    _check(v.routing in ("affinity", "least_loaded", "round_robin"),
           f"server.routing={v.routing!r}: expected affinity, least_loaded or round_robin")
    _check(v.max_imbalance >= 0, f"server.max_imbalance={v.max_imbalance}: expected >= 0")
    for key in ("max_body_mb", "max_reading_mb", "body_timeout_s", "header_timeout_s"):
        _check(getattr(v, key) > 0, f"server.{key}={getattr(v, key)}: expected > 0")
    _check(v.max_reading_mb >= v.max_body_mb,
           f"server.max_reading_mb={v.max_reading_mb}: expected >= server.max_body_mb ({v.max_body_mb})")
    _check(v.max_connections >= 1, f"server.max_connections={v.max_connections}: expected >= 1")
    _check(v.lora_roots is None or (isinstance(v.lora_roots, (list, tuple)) and
                                    all(isinstance(r, str) and r for r in v.lora_roots)),
           f"server.lora_roots={v.lora_roots!r}: expected a list of directories or null")


def world_size_of(p: ParallelConfig) -> int:
    """The ranks a launch without torchrun starts: parallel.dp_size (or the EP group over DP replicas) x tp_size."""
    dp = p.dp_size or (p.ep_size if p.ep_size > 1 and p.ep_attention == "dp" else 1)
    return dp * p.tp_size


def validate_for_model(hf: dict, tp_size: int) -> None:
    """Checks of the parallel layout against a HF config.json (dict)."""
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    checks = [("num_attention_heads", heads), ("intermediate_size", hf["intermediate_size"]),
              ("vocab_size", hf["vocab_size"])]
    for name, value in checks:
        _check(value % tp_size == 0, f"parallel.tp_size={tp_size} does not divide the model's {name}={value}")
    _check(kv % tp_size == 0 or tp_size % kv == 0,
           f"parallel.tp_size={tp_size} and the model's num_key_value_heads={kv}: one must divide the other "
           f"(KV heads are split, or replicated when tp_size > num_key_value_heads)")


def resolve_device(name: str) -> str:
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but torch sees no CUDA device (device=cpu runs on the CPU)")
    return name


def resolve_dtype(name: str, device: str):
    import torch
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, name)
