"""Triton kernels of the decoder layer's fused ops, with the signatures of the references in tp_lora/ops/fused.py.

Math in float32, rounded to the activations' dtype at the points where the torch references round (after the
residual add, after a norm, after each product of RoPE), so low-precision results match them but for summation
order. Launches depend on shapes only (no host syncs): a CUDA graph captures them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.split_sums import SplitSums
from tp_lora.ops.triton.dot import TL_TYPES
from tp_lora.ops.triton.fp8_quant import FP8_DTYPE, quantize_row8
from tp_lora.ops.triton.pdl import pdl_args, release_next, released, wait_prior

ACT_BLOCK = 1024  # columns of act_mul per program
COMBINE_BLOCK = 1024  # columns of moe_combine per program
EMBED_BLOCK = 1024  # columns of embedding_shard per program
DECODE_ROWS = 64  # rows up to which the norms and act_mul launch for latency (decode), not throughput


@triton.jit
def _weighted(h, w, OFFSET: tl.constexpr, DT: tl.constexpr):
    """Normalised float32 h times the norm weight w (float32), rounded as rms_norm_ref does."""
    if OFFSET:
        y = (h * (1.0 + w)).to(DT)
    else:
        y = (w * h.to(DT).to(tl.float32)).to(DT)
    return y


@triton.jit
def add_norm_row(h, res_row, w_ptr, xw_ptr, out_row, res_out_row, q_row, s_row, i, ok, n, eps,
                 HAS_RES: tl.constexpr, NORM_X: tl.constexpr, OFFSET: tl.constexpr, Q8: tl.constexpr):
    """One row of add_rms_norm from h [BLOCK] float32 (x, masked by ok): the optional norm of x, the residual add
    (stored at res_out_row), the norm (stored at out_row; Q8: also quantized to q_row, its scales to s_row, per
    token (1) or per Q8 columns (quantize_row8)); row pointers, columns i."""
    dt = out_row.dtype.element_ty
    if NORM_X:
        xw = tl.load(xw_ptr + i, mask=ok, other=0.0).to(tl.float32)
        h = _weighted(h * tl.rsqrt(tl.sum(h * h, 0) / n + eps), xw, OFFSET, dt).to(tl.float32)
    if HAS_RES:
        h = (h + tl.load(res_row + i, mask=ok, other=0.0).to(tl.float32)).to(dt)
        tl.store(res_out_row + i, h, mask=ok)
        h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / n + eps)
    w = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
    y = _weighted(h * rstd, w, OFFSET, dt)
    tl.store(out_row + i, y, mask=ok)
    if Q8:
        quantize_row8(y.to(tl.float32), q_row, s_row, i, ok, Q8)


@triton.jit
def load_shares(at, col_at, d_at, ok, rs, s_share, SHARES: tl.constexpr, COL: tl.constexpr, DELTA: tl.constexpr,
                DT: tl.constexpr):
    """The values at `at` in float32; SHARES > 0: a GEMM's SplitSums output there (its SHARES float32 partials
    s_share apart, added in order, times the column scales at col_at (COL) and the row's scale rs, rounded to DT;
    DELTA: plus their delta at d_at, rounded again)."""
    x = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    if SHARES:
        x = tl.zeros_like(x) + x  # 0 + the first share, as SplitSums.total adds them
        for s in tl.static_range(1, SHARES):
            x += tl.load(at + s * s_share, mask=ok, other=0.0)
        if COL:
            x *= tl.load(col_at, mask=ok, other=0.0)
        x = (x * rs).to(DT).to(tl.float32)
        if DELTA:
            x = (x + tl.load(d_at, mask=ok, other=0.0)).to(DT).to(tl.float32)
    return x


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, xw_ptr, out_ptr, res_out_ptr, q_ptr, qs_ptr, col_ptr, row_ptr,
                         d_ptr, s_x, s_part, s_r, s_o, s_ro, s_q, s_qs, n, eps, BLOCK: tl.constexpr,
                         HAS_RES: tl.constexpr, NORM_X: tl.constexpr, OFFSET: tl.constexpr, Q8: tl.constexpr,
                         PARTS: tl.constexpr, COL: tl.constexpr, ROW: tl.constexpr, DELTA: tl.constexpr,
                         PDL: tl.constexpr):
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < n
    rs = tl.load(row_ptr + t) if ROW else 1.0
    # PARTS: x is a GEMM's SplitSums, its K shares added in order, scaled and rounded as the GEMM would have
    h = load_shares(x_ptr + t * s_x + i, col_ptr + i, d_ptr + t * s_x + i, ok, rs, s_part, PARTS, COL, DELTA,
                    out_ptr.dtype.element_ty)
    release_next(PDL)
    add_norm_row(h, res_ptr + t * s_r, w_ptr, xw_ptr, out_ptr + t * s_o, res_out_ptr + t * s_ro, q_ptr + t * s_q,
                 qs_ptr + t * s_qs, i, ok, n, eps, HAS_RES, NORM_X, OFFSET, Q8)


@triton.jit
def rope_inputs(src, n_rows, s_h, cos_row, sin_row, w_ptr, col_src, d_src, rs, s_share, ROWS: tl.constexpr,
                D: tl.constexpr, D_PAD: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr, DT: tl.constexpr,
                SHARES: tl.constexpr, COL: tl.constexpr, DELTA: tl.constexpr):
    """norm_rope's loads: heads [n_rows, D] at src and their rotate_half partners as load_shares reads them (x, xp
    [ROWS, D_PAD] float32), cos and sin [1, D_PAD] and (NORM) the norm weights at the same columns (w, wp; else
    cos, sin). Apart from rope_apply, so a kernel can issue several heads' loads at once."""
    h = tl.arange(0, ROWS)[:, None]
    i = tl.arange(0, D_PAD)[None, :]
    ok = (h < n_rows) & (i < D)
    rot = i < R
    half = R // 2
    partner = tl.where(i < half, i + half, i - half)  # rotate_half reads dim i + R/2 (negated) or i - R/2
    x = load_shares(src + h * s_h + i, col_src + h * s_h + i, d_src + h * s_h + i, ok, rs, s_share, SHARES, COL,
                    DELTA, DT)
    xp = load_shares(src + h * s_h + partner, col_src + h * s_h + partner, d_src + h * s_h + partner, ok & rot, rs,
                     s_share, SHARES, COL, DELTA, DT)
    c = tl.load(cos_row + i, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(sin_row + i, mask=rot, other=0.0).to(tl.float32)
    w, wp = c, s
    if NORM:
        w = tl.load(w_ptr + i, mask=i < D, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    return x, xp, c, s, w, wp


@triton.jit
def rope_apply(x, xp, c, s, w, wp, eps, D: tl.constexpr, D_PAD: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr,
               OFFSET: tl.constexpr, DT: tl.constexpr):
    """norm_rope's math on rope_inputs' loads: the optional per-head RMSNorm, then RoPE on the first R dims."""
    i = tl.arange(0, D_PAD)[None, :]
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        x = _weighted(x * rstd, w, OFFSET, DT).to(tl.float32)
        xp = _weighted(xp * rstd, wp, OFFSET, DT).to(tl.float32)
    xp = tl.where(i < R // 2, -xp, xp)
    y = ((x * c).to(DT).to(tl.float32) + (xp * s).to(DT).to(tl.float32)).to(DT)
    return tl.where(i < R, y, x.to(DT))


@triton.jit
def norm_rope(src, n_rows, s_h, cos_row, sin_row, w_ptr, eps, ROWS: tl.constexpr, D: tl.constexpr,
              D_PAD: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr, OFFSET: tl.constexpr, DT: tl.constexpr):
    """Heads [n_rows, D] at src (head stride s_h) -> [ROWS, D_PAD] in DT: the optional per-head RMSNorm, then RoPE on
    the first R dims (x * cos + rotate_half(x) * sin), the rest passed through."""
    x, xp, c, s, w, wp = rope_inputs(src, n_rows, s_h, cos_row, sin_row, w_ptr, src, src, 1.0, 0, ROWS, D, D_PAD, R,
                                     NORM, DT, 0, False, False)
    return rope_apply(x, xp, c, s, w, wp, eps, D, D_PAD, R, NORM, OFFSET, DT)


@triton.jit
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slots_ptr, qw_ptr, kw_ptr,
                          q_out_ptr, eps, k_inv, v_inv, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_cos, s_sin, s_cs, s_ch,
                          s_vcs, s_vch, H: tl.constexpr, KV: tl.constexpr, H_PAD: tl.constexpr,
                          KV_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, R: tl.constexpr,
                          NORM: tl.constexpr, OFFSET: tl.constexpr, SCALED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dt = q_out_ptr.dtype.element_ty
    cos_row, sin_row = cos_ptr + t * s_cos, sin_ptr + t * s_sin
    i = tl.arange(0, D_PAD)[None, :]
    hq = tl.arange(0, H_PAD)[:, None]
    q = norm_rope(q_ptr + t * s_qt, H, s_qh, cos_row, sin_row, qw_ptr, eps, H_PAD, D, D_PAD, R, NORM, OFFSET, dt)
    tl.store(q_out_ptr + t * H * D + hq * D + i, q, mask=(hq < H) & (i < D))
    hk = tl.arange(0, KV_PAD)[:, None]
    ok = (hk < KV) & (i < D)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    k = norm_rope(k_ptr + t * s_kt, KV, s_kh, cos_row, sin_row, kw_ptr, eps, KV_PAD, D, D_PAD, R, NORM, OFFSET, dt)
    v = tl.load(v_ptr + t * s_vt + hk * s_vh + i, mask=ok, other=0.0)
    if SCALED:  # an fp8 cache holds k / k_scale and v / v_scale
        k = k.to(tl.float32) * k_inv
        v = v.to(tl.float32) * v_inv
    tl.store(kc_ptr + slot * s_cs + hk * s_ch + i, k, mask=ok)
    tl.store(vc_ptr + slot * s_vcs + hk * s_vch + i, v, mask=ok)


@triton.jit
def act_mul_of(gate, up, dt: tl.constexpr, GELU: tl.constexpr):
    """act(gate) * up in dt, from gate and up (float32) each rounded to dt first, and act(gate) rounded to dt before
    the product: act_mul's rounding of a gate_up output in dt."""
    g = gate.to(dt).to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(z)) with z = sqrt(2 / pi) (g + 0.044715 g^3), and 1 + tanh(z) = 2 sigmoid(2z)
        a = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    else:
        a = g * tl.sigmoid(g)
    return (a.to(dt).to(tl.float32) * up.to(dt).to(tl.float32)).to(dt)


@triton.jit
def _act_mul_block(x_row, out_row, i, ok, n, GELU: tl.constexpr, PDL: tl.constexpr):
    """act(gate) * up at columns i of one row, stored (out's dtype) and returned in float32 (0 where masked); the
    next kernel released once the inputs are loaded."""
    g = tl.load(x_row + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_row + n + i, mask=ok, other=0.0).to(tl.float32)
    release_next(PDL)
    y = act_mul_of(g, u, out_row.dtype.element_ty, GELU)
    tl.store(out_row + i, y, mask=ok)
    return y.to(tl.float32)


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, q_ptr, qs_ptr, s_x, s_o, s_q, s_qs, n, BLOCK: tl.constexpr, GELU: tl.constexpr,
                    Q8: tl.constexpr, PDL: tl.constexpr):
    """Programs over (row, BLOCK columns). Q8: the output also quantized (quantize_row8): per token (1) the whole
    row in one tile (its amax needs every column), per Q8 columns (> 1) a tile's groups."""
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    y = _act_mul_block(x_ptr + t * s_x, out_ptr + t * s_o, i, i < n, n, GELU, PDL)
    if Q8:
        quantize_row8(y, q_ptr + t * s_q, qs_ptr + t * s_qs, i, i < n, Q8)


def as_rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """x as [T, N] rows with a unit column stride (a view where it can be)."""
    x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        raise ValueError(f"{what} needs a unit stride along its last dim, got strides {tuple(x.stride())}")
    return x


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, N] with a unit column stride: itself where it has one (a strided view's rows are read where they lie,
    the EP dispatch's unpacked columns), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def add_rms_norm(x: torch.Tensor | SplitSums, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 offset: bool = False, x_weight: torch.Tensor | None = None,
                 out8: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: a tensor, or (with a residual) a GEMM's SplitSums, summed here as that GEMM would have."""
    sums = x if isinstance(x, SplitSums) else None
    if sums is not None:
        if residual is None or sums.parts.stride(-1) != 1 or sums.parts.stride(0) != sums.parts[0].numel():
            raise ValueError(f"add_rms_norm: SplitSums need a residual and contiguous parts, got strides "
                             f"{tuple(sums.parts.stride())}, residual {residual is not None}")
        rows = as_rows(sums.parts[0], "add_rms_norm's x")
        shape, dtype = rows.shape, sums.dtype
    else:
        rows = as_rows(x, "add_rms_norm's x")
        shape, dtype = x.shape, x.dtype
    n = rows.shape[1]
    out = torch.empty(shape, dtype=dtype, device=rows.device)
    if residual is None:
        res, res_out = rows, x
    else:
        res, res_out = as_rows(residual, "add_rms_norm's residual"), torch.empty_like(out)
    res_rows = rows if residual is None else res_out.view(-1, n)
    q, qs, q8 = check_rows8("add_rms_norm", out8, rows.shape[0], n, out)
    col = None if sums is None else sums.col
    row = None if sums is None else sums.row
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](
            rows if sums is None else sums.parts, res, weight, weight if x_weight is None else x_weight, out,
            res_rows, q, qs, weight if col is None else col, weight if row is None else row.reshape(-1),
            rows if sums is None or sums.delta is None else sums.delta,
            rows.stride(0), rows.numel(), res.stride(0), n, n, q.stride(0), qs.stride(0), n, float(eps),
            BLOCK=triton.next_power_of_2(n),
            HAS_RES=residual is not None, NORM_X=x_weight is not None, OFFSET=bool(offset), Q8=q8,
            PARTS=0 if sums is None else sums.parts.shape[0], COL=col is not None, ROW=row is not None,
            DELTA=sums is not None and sums.delta is not None, num_warps=norm_warps(rows.shape[0], n),
            **pdl_args(rows if sums is None else sums.parts))
        released(out, q)
    return out, res_out


def norm_warps(t: int, n: int) -> int:
    """Warps of add_rms_norm's program a row: 16 for decode's rows of 4096 columns or more (their latency), else
    4 up to 4096 columns, 8 past them."""
    return 16 if t <= DECODE_ROWS and n >= 4096 else 4 if n <= 4096 else 8


def act_warps(t: int, block: int) -> int:
    """Warps of act_mul's programs of block columns: a warp per 512 at decode's rows (the whole row's per-token
    quantization), per 1024 past them; 4 to 32."""
    return min(32, max(4, block // (512 if t <= DECODE_ROWS else 1024)))


def check_rows8(op: str, out8, t: int, n: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(q, scales [t, groups], Q8) of an op's out8 for t rows of n columns, checked: Q8 1 per token (scales [t] or
    [t, 1]), else per Q8 columns (scales [t, n / Q8] row-major, Q8 a power of two of at most ACT_BLOCK); without
    out8, any two tensors the kernel never touches (out) and Q8 0."""
    if out8 is None:
        return out.view(-1, n), out.view(-1, n), 0
    q, qs = out8
    groups = qs.shape[-1] if qs.dim() == 2 else 1
    width = n // max(1, groups)
    if (q.shape != (t, n) or q.dtype != FP8_DTYPE or q.stride(-1) != 1 or qs.numel() != t * groups
            or qs.dtype != torch.float32 or qs.stride(-1) != 1 or (t > 1 and qs.stride(0) != groups)
            or width * groups != n or (groups > 1 and (width & (width - 1) or width > ACT_BLOCK))):
        raise ValueError(f"{op}: out8 needs q [{t}, {n}] {FP8_DTYPE} (unit column stride) and row-major float32 "
                         f"scales, {t} (per token) or [{t}, {n} / G] (per G columns, G a power of two of at most "
                         f"{ACT_BLOCK}), got {tuple(q.shape)} {q.dtype} and {tuple(qs.shape)} {qs.dtype}")
    return q, qs.view(t, groups), 1 if groups == 1 else width


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0,
                  offset: bool = False, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    t, heads, d = q.shape
    kv, r = k.shape[1], cos.shape[-1]
    for name, x in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"rope_write_kv needs a unit stride along {name}'s last dim, got {tuple(x.stride())}")
    if r > d or r % 2:
        raise ValueError(f"rope_write_kv: rotary dim {r} must be even and at most head_dim {d}")
    kc, vc = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    out = torch.empty(t, heads, d, dtype=q.dtype, device=q.device)
    norm = q_weight is not None
    if t:
        _rope_write_kv_kernel[(t,)](
            q, k, v, cos, sin, kc, vc, slots, q_weight if norm else q, k_weight if norm else k, out, float(eps),
            1.0 / kv_scales[0], 1.0 / kv_scales[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), cos.stride(0), sin.stride(0), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
            H=heads, KV=kv, H_PAD=triton.next_power_of_2(heads), KV_PAD=triton.next_power_of_2(kv), D=d,
            D_PAD=triton.next_power_of_2(d), R=r, NORM=norm, OFFSET=bool(offset),
            SCALED=k_cache.dtype == torch.float8_e4m3fn and tuple(kv_scales) != (1.0, 1.0),
            num_warps=4 if heads * d <= 4096 else 8)
    return out


def act_mul(x: torch.Tensor, act: str, out8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"act_mul: activation {act!r} is not supported (expected silu or gelu_pytorch_tanh)")
    rows = as_rows(x, "act_mul's input")
    t, n = rows.shape[0], rows.shape[1] // 2
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    gelu = act == "gelu_pytorch_tanh"
    q, qs, q8 = check_rows8("act_mul", out8, t, n, out)
    block = triton.next_power_of_2(n) if q8 == 1 else ACT_BLOCK
    if t:
        _act_mul_kernel[(t, triton.cdiv(n, block))](rows, out, q, qs, rows.stride(0), n, q.stride(0), qs.stride(0), n,
                                                    BLOCK=block, GELU=gelu, Q8=q8,
                                                    num_warps=act_warps(t, block), **pdl_args(rows))
        released(out, q)
    return out


@triton.jit
def _embedding_shard_kernel(w_ptr, ids_ptr, out_ptr, start, rows, s_w, h, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    local = tl.load(ids_ptr + t + c * 0) - start  # (a vector: the interpreter takes no scalar mask)
    inside = (local >= 0) & (local < rows)
    v = tl.load(w_ptr + local * s_w + c, mask=inside & (c < h), other=0.0)
    tl.store(out_ptr + t * h + c, v, mask=c < h)


def embedding_shard(weight: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """embedding_shard_ref's rows in one launch."""
    if weight.stride(-1) != 1:
        raise ValueError(f"embedding_shard: the weight needs a unit stride along H, got {tuple(weight.stride())}")
    flat = ids.reshape(-1).contiguous()
    h = weight.shape[1]
    out = torch.empty(flat.shape[0], h, dtype=weight.dtype, device=weight.device)
    _embedding_shard_kernel[(flat.shape[0], triton.cdiv(h, EMBED_BLOCK))](
        weight, flat, out, start, weight.shape[0], weight.stride(0), h, BLOCK=EMBED_BLOCK)
    return out.view(*ids.shape, h)


@triton.jit
def _moe_combine_kernel(yp_ptr, pos_ptr, w_ptr, out_ptr, s_y, s_w, s_o, n, K: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    wait_prior(PDL)
    release_next(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        p = tl.load(pos_ptr + t * K + j)
        w = tl.load(w_ptr + t * s_w + j)
        row = tl.load(yp_ptr + tl.maximum(p, 0).to(tl.int64) * s_y + i, mask=ok & (i * 0 + p >= 0), other=0.0)
        acc += row.to(tl.float32) * w
    tl.store(out_ptr + t * s_o + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_combine(yp: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    yp = as_rows(yp, "moe_combine yp")
    n, k = pos.shape
    h = yp.shape[1]
    out = torch.empty(n, h, dtype=yp.dtype, device=yp.device)
    grid = (n, triton.cdiv(h, COMBINE_BLOCK))
    w = unit_rows(weight.float())
    _moe_combine_kernel[grid](yp, pos.contiguous(), w, out, yp.stride(0), w.stride(0), out.stride(0), h, K=k,
                              BLOCK=COMBINE_BLOCK, **pdl_args(yp))
    released(out)
    return out


@triton.jit
def _moe_topk_kernel(logits_ptr, ids_ptr, w_ptr, valid_ptr, s_l, s_share, E, K: tl.constexpr,
                     K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr,
                     HAS_VALID: tl.constexpr, SHARES: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    release_next(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    # SHARES: the router GEMM's SplitSums, its K shares added in order and rounded to the logits' dtype DT
    x = load_shares(logits_ptr + t * s_l + e, logits_ptr, logits_ptr, e < E, 1.0, s_share, SHARES, False, False, DT)
    x = tl.where(e < E, x, -float("inf"))
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    j = tl.arange(0, K_PAD)
    ids = tl.zeros((K_PAD,), dtype=tl.int32)
    w = tl.zeros((K_PAD,), dtype=tl.float32)
    for r in tl.static_range(K):  # the largest left, the lowest index among equals
        m = tl.max(p, 0)
        i = tl.min(tl.where(p == m, e, E_PAD), 0)
        ids = tl.where(j == r, i, ids)
        w = tl.where(j == r, m, w)
        p = tl.where(e == i, -1.0, p)
    if RENORM:
        w = w / tl.sum(w, 0)
    if ROUND:
        w = w.to(DT).to(tl.float32)
    if HAS_VALID:  # a graph's padding row routes nowhere
        ids = tl.where(j * 0 + t >= tl.load(valid_ptr), -1, ids)
    tl.store(ids_ptr + t * K + j, ids.to(tl.int64), mask=j < K)
    tl.store(w_ptr + t * K + j, w, mask=j < K)


def moe_topk(logits: torch.Tensor | SplitSums, k: int, renormalize: bool, round_weights: bool,
             valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: a tensor, or the router GEMM's SplitSums (the kernel sums its shares)."""
    sums = logits if isinstance(logits, SplitSums) else None
    if sums is not None and (sums.col is not None or sums.row is not None or sums.delta is not None):
        raise ValueError("moe_topk takes SplitSums of a 16-bit GEMM's shares only (no scales, no delta)")
    rows = as_rows(logits if sums is None else sums.parts[0], "moe_topk's logits")
    n, e = rows.shape
    if not 1 <= k <= e:
        raise ValueError(f"moe_topk: k={k} outside 1..{e} (the number of experts)")
    ids = torch.empty(n, k, dtype=torch.int64, device=rows.device)
    w = torch.empty(n, k, dtype=torch.float32, device=rows.device)
    dt = rows.dtype if sums is None else sums.dtype
    # one warp a row: its softmax and k rounds of max / min reduce within the warp (no shared-memory round trips)
    _moe_topk_kernel[(n,)](rows, ids, w, ids if valid is None else valid, rows.stride(0),
                           0 if sums is None else sums.parts.stride(0), e, K=k,
                           K_PAD=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(e), RENORM=renormalize,
                           ROUND=round_weights, HAS_VALID=valid is not None,
                           SHARES=0 if sums is None else sums.parts.shape[0], DT=TL_TYPES[dt], num_warps=1,
                           **pdl_args(rows))
    released(ids, w)
    return ids, w
