"""The decoder layer's small fused ops: torch references (the CPU path and the test oracle) and the dispatchers the
model calls, which take the Triton kernels of tp_lora/ops/triton/fused.py on CUDA.

- add_rms_norm: (x + residual) then RMSNorm, returning both; residual None: RMSNorm of x alone; x_weight: x is
  RMS-normed first (Gemma's post-attention norm, then the add and the pre-feedforward norm).
- reduce_add_rms_norm: add_rms_norm of x summed over a tp group (a row-parallel layer's partial output), or of this
  rank's chunk of it (scatter: the EP experts' sums of every rank's tokens): one kernel
  over peer memory where the group has it (tp_lora/ops/triton/peer_norm.py), else all_reduce then add_rms_norm.
- rope_write_kv: per-head RMSNorm of q and k (Qwen3 / Gemma 3, optional), rotate-half RoPE on the first r dims of
  each head, and the write of k and v into the paged cache at the step's slots; returns q.
- act_mul: act(gate) * up on the packed [gate | up] output of gate_up_proj (silu, or Gemma's gelu_pytorch_tanh).
- out8 (the norms, act_mul; kernels only): the output also written quantized into (q, scales), the activations of
  the fp8 GEMM that reads it (tp_lora.ops.fp8.fp8_linear's x8): per token (scales [T] or [T, 1]: per-channel
  layers), or per G columns (scales [T, n / G]: block-scaled layers at decode, G 128).
- add_rms_norm's x may be a decode GEMM's SplitSums (tp_lora.ops.split_sums: its K shares' partial sums), which
  the kernel adds, scales and rounds as the GEMM would have, while it loads them.
- moe_topk: the MoE router's softmax (float32), top-k, optional renormalisation and rounding of the weights; a CUDA
  graph's padding rows route nowhere.
- embedding_shard: the rows of a vocabulary shard for a step's token ids, zeros for ids other ranks hold.
- moe_combine: each token's router-weighted sum of its top-k expert outputs (rows of a routing plan's pair order),
  accumulated in float32 and rounded once; no atomics, so the sum's order is fixed.

Every op computes as the torch modules do, rounding to the activations' dtype where they round, so the kernels match
the references to the last bit but for summation order and fast math.
"""
from __future__ import annotations

import torch

from tp_lora import distributed as comm
from tp_lora.ops.split_sums import SplitSums

# None: the Triton kernels for CUDA tensors, else the references; True / False forces (tests, benchmarks). The MoE
# routing plan, grouped GEMM and sampling dispatchers (tp_lora.ops.moe_plan, .grouped_mm, .sampling) follow it too.
KERNELS: bool | None = None

# (q [T, N] float8_e4m3fn, scales [T, 1] float32): an op's output also quantized per token, as
# tp_lora.ops.fp8.quantize_per_token does, for the fp8 GEMM it feeds (the norms' and act_mul's out8); or scales
# [T, G]: per (token, N / G columns), as the ACT8 decode GEMM quantizes (decode attention's, a head a group)
Rows8 = tuple[torch.Tensor, torch.Tensor]

ACTIVATIONS = {"silu": torch.nn.functional.silu,
               "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda if KERNELS is None else KERNELS


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim in float32, cast back as transformers does: Llama before the weight, Gemma (offset:
    the weight stored as w - 1, applied as 1 + w) after it."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     offset: bool = False, x_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, N] -> (RMSNorm(x + residual), x + residual); residual None: (RMSNorm(x), x). x_weight [N]
    (with a residual only): x becomes RMSNorm(x) with that weight (same eps and offset) first."""
    if x_weight is not None:
        x = rms_norm_ref(x, x_weight, eps, offset)
    h = x if residual is None else x + residual
    return rms_norm_ref(h, weight, eps, offset), h


def reduce_add_rms_norm_ref(x: torch.Tensor | SplitSums, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float, offset: bool, x_weight: torch.Tensor | None, group: comm.Group,
                            scatter: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] this rank's partial sums (or a GEMM's SplitSums of them) -> add_rms_norm_ref of x summed over the
    group (a tensor x is reduced in place). scatter: x [world * C, N] holds each rank's chunk of C rows; this rank's
    chunk, summed, to its first rows (the residual's, else C): add_rms_norm_ref of reduce_scatter(x)[:rows]."""
    x = x.total() if isinstance(x, SplitSums) else x
    return add_rms_norm_ref(_summed(x, residual, group, scatter), residual, weight, eps, offset, x_weight)


def _summed(x: torch.Tensor, residual: torch.Tensor | None, group: comm.Group, scatter: bool) -> torch.Tensor:
    """x all-reduced over the group, or (scatter) this rank's chunk of it cut to the residual's rows."""
    if not scatter:
        return comm.all_reduce(x, group)
    own = comm.reduce_scatter(x, group)
    return own if residual is None else own[:residual.shape[0]]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, 1, r], r <= d (the rotate-half convention of HF checkpoints on the first r)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([rotate(x[..., :r], cos, sin), x[..., r:]], -1)
    half = r // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0,
                      offset: bool = False, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """q [T, H, d], k / v [T, KV, d] (views of the packed qkv output); cos / sin [T, 1, r]; caches [blocks, bs, KV, d];
    slots [T] (block * bs + offset). q_weight / k_weight [d]: the per-head RMSNorm before RoPE (both or neither).
    kv_scales: an fp8 cache's (k, v) scales (it holds k / k_scale, v / v_scale). Writes RoPE(k) and v at the slots;
    returns RoPE(q) [T, H, d]."""
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps, offset), rms_norm_ref(k, k_weight, eps, offset)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    write_kv(k_cache, v_cache, slots, k, v, kv_scales)
    return q


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """k / v [T, KV, d] into the paged caches [blocks, bs, KV, d] at slots [T] (block * bs + offset). An fp8 cache
    takes k / k_scale and v / v_scale (multiplied by the reciprocals in float32, as the kernel does), saturated at its
    largest finite value, as the kernels' conversion does."""
    if k_cache.dtype == torch.float8_e4m3fn:
        big = torch.finfo(torch.float8_e4m3fn).max
        k, v = ((x.float() * (1.0 / s)).clamp(-big, big).to(k_cache.dtype) for x, s in zip((k, v), kv_scales))
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v


def act_mul_ref(x: torch.Tensor, act: str) -> torch.Tensor:
    """x [T, 2n] = [gate | up] -> act(gate) * up [T, n]."""
    gate, up = x.chunk(2, -1)
    return ACTIVATIONS[act](gate) * up


def embedding_shard_ref(weight: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """weight [V_p, H] (vocabulary rows start..start + V_p), ids [...] int -> [..., H]: weight[id - start] where this
    shard holds id, else zeros."""
    local = ids - start
    inside = (local >= 0) & (local < weight.shape[0])
    return weight[local.clamp(0, weight.shape[0] - 1)] * inside.unsqueeze(-1).to(weight.dtype)


def moe_topk_ref(logits: torch.Tensor, k: int, renormalize: bool, round_weights: bool,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, E] in the model dtype -> topk ids [n, k] int64, weights [n, k] float32 of softmax(logits) in float32,
    renormalised to sum 1 (renormalize), rounded through the logits' dtype (round_weights). valid [1] int (a CUDA
    graph's real rows): rows from valid[0] on route nowhere (ids -1)."""
    w, ids = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    if round_weights:
        w = w.to(logits.dtype).float()
    if valid is not None:
        ids = ids.masked_fill((torch.arange(ids.shape[0], device=ids.device) >= valid)[:, None], -1)
    return ids, w


def moe_combine_ref(yp: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """yp [C, H] expert outputs in pair order, pos [N, k] int (row of pair (t, j) in yp, -1: not computed here),
    weight [N, k] float32 -> [N, H] in yp's dtype: sum over j of weight[t, j] * yp[pos[t, j]], in float32."""
    n, k = pos.shape
    if yp.shape[0] == 0:
        return yp.new_zeros(n, yp.shape[1])
    ok = (pos >= 0)[..., None]
    rows = torch.where(ok, yp[pos.clamp(min=0).long()].float(), 0.0)  # rows never computed may hold anything
    out = rows[:, 0] * weight[:, :1]
    for j in range(1, k):
        out = out + rows[:, j] * weight[:, j:j + 1]
    return out.to(yp.dtype)


def add_rms_norm(x: torch.Tensor | SplitSums, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 offset: bool = False, x_weight: torch.Tensor | None = None, out8: Rows8 | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: a tensor, or a GEMM's SplitSums (the kernel sums them; with a residual, else they are summed first)."""
    if residual is None and x_weight is not None:
        raise ValueError("add_rms_norm: x_weight (a norm before the residual add) needs a residual, got None")
    if isinstance(x, SplitSums) and (residual is None or not use_kernels(x.parts)):
        x = x.total()
    if isinstance(x, SplitSums) or use_kernels(x):
        from tp_lora.ops.triton.fused import add_rms_norm as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(x, residual, weight, eps, offset, x_weight, out8)
    no_rows8("add_rms_norm", out8)
    return add_rms_norm_ref(x, residual, weight, eps, offset, x_weight)


def reduce_add_rms_norm(x: torch.Tensor | SplitSums, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        offset: bool, x_weight: torch.Tensor | None, group: comm.Group, scatter: bool = False,
                        out8: Rows8 | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: a tensor, or a GEMM's SplitSums (the peer kernel sums them; else, or without a residual, summed first)."""
    if residual is None and x_weight is not None:
        raise ValueError("reduce_add_rms_norm: x_weight (a norm before the residual add) needs a residual, got None")
    sums = isinstance(x, SplitSums)
    # the message: x's rows in the stream's dtype (a SplitSums' rows have the residual's shape and dtype)
    buf = None if sums and (residual is None or scatter) else comm.fused_peer(residual if sums else x, group, scatter)
    if sums and buf is None:
        x = x.total()
    if buf is not None:
        from tp_lora.ops.triton.peer_norm import reduce_add_rms_norm as kernel  # noqa: PLC0415 - peer path only
        return kernel(x, residual, weight, eps, offset, x_weight, buf, scatter, out8)
    return add_rms_norm(_summed(x, residual, group, scatter), residual, weight, eps, offset, x_weight, out8)


def no_rows8(op: str, out8: Rows8 | None) -> None:
    """The references emit no fp8 rows: out8 is for the kernels (tp_lora.ops.fp8.takes_rows8 asks for them)."""
    if out8 is not None:
        raise ValueError(f"{op}: out8 (the output quantized per token) is written by the Triton kernels only")


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0,
                  offset: bool = False, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    if use_kernels(q):
        from tp_lora.ops.triton.fused import rope_write_kv as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(q, k, v, cos, sin, k_cache, v_cache, slots, q_weight, k_weight, eps, offset, kv_scales)
    return rope_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slots, q_weight, k_weight, eps, offset, kv_scales)


def act_mul(x: torch.Tensor, act: str, out8: Rows8 | None = None) -> torch.Tensor:
    if use_kernels(x):
        from tp_lora.ops.triton.fused import act_mul as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(x, act, out8)
    no_rows8("act_mul", out8)
    return act_mul_ref(x, act)


def moe_topk(logits: torch.Tensor | SplitSums, k: int, renormalize: bool, round_weights: bool,
             valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: a tensor, or the router GEMM's SplitSums (the kernel sums them)."""
    if isinstance(logits, SplitSums) and not use_kernels(logits.parts):
        logits = logits.total()
    if isinstance(logits, SplitSums) or use_kernels(logits) and logits.shape[0]:
        from tp_lora.ops.triton.fused import moe_topk as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(logits, k, renormalize, round_weights, valid)
    return moe_topk_ref(logits, k, renormalize, round_weights, valid)


def embedding_shard(weight: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    if use_kernels(weight) and ids.numel():
        from tp_lora.ops.triton.fused import embedding_shard as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(weight, ids, start)
    return embedding_shard_ref(weight, ids, start)


def moe_combine(yp: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if use_kernels(yp) and yp.shape[0] and pos.shape[0]:
        from tp_lora.ops.triton.fused import moe_combine as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(yp, pos, weight)
    return moe_combine_ref(yp, pos, weight)
