"""FP8 (e4m3): storage for LoRA weights (per-output-channel scales, dequantised inside the kernels) and the base
layers' fp8 weights (tp_lora.layers.quant): their dequantisation, activation quantization and the GEMM.

    fp8_linear(x [T, K], w [N, K] fp8, scale, block_k, block_n=None, x8=None) -> [T, N] in x's dtype
    scale: [N] per output channel (block_k None), or [N, ceil(K / block_k)] per block of block_k columns.

With the Triton kernels on a device that reads fp8 (CUDA sm89+, or the interpreter), at decode the split-K GEMM
tp_lora.ops.triton.fp8_gemm.w8a16_mm, which reads only the fp8 bytes: for 16-bit activations up to ACT8_ROWS rows
(scales per channel or per blocks of a multiple of 128 columns) it quantizes them per (row, 128 columns) in its main
loop and multiplies on the fp8 tensor cores (ACT8: the activations' quantization of transformers' fine-grained fp8
layers; per-channel rows that their producer quantized per token, x8, go straight to the fp8 tensor cores: the
XQ form); otherwise, up to small_rows(w, block_k) rows, weight-only (fp8 tiles widened in registers, scales on the
partial sums; float32 activations are never quantized). More rows, W8A8 on the fp8 tensor cores with the
activations quantized by one Triton kernel (or by their producer, x8): per-channel weights through
torch._scaled_mm (rowwise scales, fast accumulation); [128, 128]-block weights through cuBLAS's block-scaled GEMM
(F.scaled_mm, sm90) where the layer's rows lie in whole blocks, else the Triton w8a8_mm (scales per K tile in its
main loop). Elsewhere (the CPU): the weights dequantised in float32, cast to x's dtype, then one GEMM: the exact
reference the tests compare layouts with.
w8a16_mm_ref / w8a8_mm_ref are the Triton kernels' references (same signatures)."""
from __future__ import annotations

import threading
from functools import lru_cache

import torch

from tp_lora.ops.fused import Rows8, use_kernels
from tp_lora.ops.split_sums import SplitSums

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def _channel_scales(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 rounded once on every device: CUDA multiplies by a Python divisor's reciprocal, up to 1 ulp off,
    which moves fp8 values at rounding ties (the same checkpoint would quantize differently by device)."""
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., C, K] -> (w_fp8 [..., C, K] float8_e4m3fn, scales [..., C] float32), w ~= w_fp8 * scales[..., None].

    One scale per row: for B [L, out, r] that is per output channel, for A [L, r, in] per rank row, the channels
    the ops' b_scales / a_scales expect. All-zero rows (empty or zero-padded slots) get scale 1 and stay exact 0."""
    scales = _channel_scales(w.detach().abs().amax(dim=-1).float())
    w_fp8 = (w.float() / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_fp8, scales


_local = threading.local()


def quantize_fp8_into(dsts: list[torch.Tensor], scale_dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """quantize_fp8_per_channel of each src [C_i, K] into dst (fp8 [C_i, K]) and scale_dst ([C_i]), the same values,
    batched for a slot image on the host: the rows of every src of one width K are gathered into one float32 buffer
    kept for the thread and quantized in place there, in a few calls instead of a few per tensor. Fresh memory for
    the intermediates would cost more than the arithmetic (its page faults)."""
    groups: dict[int, list[int]] = {}
    for i, src in enumerate(srcs):
        groups.setdefault(src.shape[-1], []).append(i)
    for k, idx in groups.items():
        rows = [srcs[i].shape[0] for i in idx]
        n = sum(rows) * k
        if getattr(_local, "buf", None) is None or _local.buf.numel() < n:
            _local.buf = torch.empty(n, dtype=torch.float32)
        x = _local.buf[:n].view(-1, k)
        torch._foreach_copy_(list(x.split(rows)), [srcs[i] for i in idx])
        scales = _channel_scales(torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg_()))  # faster than aminmax
        x.div_(scales.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
        torch._foreach_copy_([dsts[i] for i in idx] + [scale_dsts[i] for i in idx],
                             list(x.split(rows)) + list(scales.split(rows)))


def dequantize(w: torch.Tensor, scale: torch.Tensor, block_k: int | None) -> torch.Tensor:
    """w [..., N, K] fp8 with scale [..., N] or, block_k set, [..., N, ceil(K / block_k)] -> float32 [..., N, K]."""
    if block_k is None:
        return w.float() * scale.unsqueeze(-1)
    return w.float() * scale.repeat_interleave(block_k, -1)[..., :w.shape[-1]]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x_fp8 [T, K], scales [T, 1] float32), one scale per row (dynamic activation quantization). The
    reference of tp_lora.ops.triton.fp8_quant.quantize_per_token."""
    scales = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
    return (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def quantize_per_group(x: torch.Tensor, group: int, rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x_fp8 [T', K], scales [T', ceil(K / group)] float32), one scale per (row, group columns): the
    activations of a block-scaled W8A8 GEMM. T' is T rounded up to a multiple of rows_to (the extra rows zeros with
    scale 1); the scales token-major (stride 1 along T'). The reference of
    tp_lora.ops.triton.fp8_quant.quantize_per_group."""
    t, k = x.shape
    g = -(-k // group)
    xp = torch.nn.functional.pad(x.float(), (0, g * group - k, 0, -t % rows_to)).view(-1, g, group)
    scales = (xp.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)
    scales[t:] = 1.0
    q = (xp / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(-1, g * group)[:, :k]
    return q.contiguous(), scales.t().contiguous().t()


def w8a16_mm_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block_k: int | None,
                 cfg: dict | None = None, x_scale: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ the dequantised w [N, K]^T in float32, rounded once to out_dtype or x's dtype (scale None: w in
    x's dtype, no scales). cfg: the kernel's launch configuration; with ACT8 x is first quantized per (row, K tile
    of min(BLOCK_K, block_k) columns) as the kernel does (quantize_per_group), else it does not matter here.
    x_scale [M, 1]: x is fp8, x * x_scale the activations."""
    xf = x.float() if x_scale is None else x.float() * x_scale.reshape(-1, 1)
    if cfg and cfg.get("ACT8") and x_scale is None:
        group = cfg["BLOCK_K"] if block_k is None else min(cfg["BLOCK_K"], block_k)
        xf = dequantize(*quantize_per_group(x, group), group)
    return (xf @ (w.float() if scale is None else dequantize(w, scale, block_k)).t()).to(out_dtype or x.dtype)


def w8a8_mm_ref(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block_k: int,
                out_dtype: torch.dtype, cfg: dict | None = None) -> torch.Tensor:
    """Activations quantized per group, xq [M, K] fp8 with xs [M, ceil(K / block_k)], times the dequantised
    block-scaled w [N, K]^T, in float32, rounded once to out_dtype."""
    return (dequantize(xq, xs, block_k) @ dequantize(w, scale, block_k).t()).to(out_dtype)


ACT8_ROWS = 32  # rows up to which 16-bit activations take the decode GEMM quantizing them per (row, 128 columns)
ACT8_GROUP = 128  # ... those columns: its K tile
SMALL_ROWS = 32  # rows up to which the kernels run the weight-only GEMM (past them W8A8 is faster)
SMALL_ROWS_WIDE = 16  # the same for wide layers (out >= 4 x in, gate_up): W8A8 wins from fewer rows there
SMALL_ROWS_DEEP = 64  # the same for per-channel layers no wider than deep (out <= in: o, down): the kernel's limit


def small_rows(w: torch.Tensor, block_k: int | None = None) -> int:
    """Rows up to which fp8_linear runs the weight-only GEMM for weights w [N, K] with scales per block of block_k
    columns (None: per channel; block scales multiply every K tile's product, which keeps the kernel from
    accumulating in place, and cuBLAS's block-scaled GEMM catches up sooner)."""
    n, k = w.shape
    if n >= 4 * k:
        return SMALL_ROWS_WIDE
    return SMALL_ROWS_DEEP if n <= k and block_k is None else SMALL_ROWS


def act8_takes(x: torch.Tensor, block_k: int | None) -> bool:
    """Whether the fp8 kernels quantize activations x per (row, 128 columns) themselves (ACT8): 16-bit x, scales
    per channel (block_k None) or per blocks of a multiple of 128 columns."""
    return x.dtype in (torch.bfloat16, torch.float16) and (block_k is None or block_k % 128 == 0)


def kernels_take(x: torch.Tensor, block_k: int | None) -> bool:
    """Whether the Triton fp8 GEMMs run for activations x and scales per block of block_k columns (None: per
    channel): the kernels are on, the device reads fp8 (CUDA sm89+, or the interpreter), block_k a power of two."""
    return (use_kernels(x) and (not x.is_cuda or _fp8_device(x.device.index))
            and (block_k is None or (block_k >= 16 and block_k & (block_k - 1) == 0)))


@lru_cache(maxsize=None)
def _fp8_device(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def scaled_mm_ok(x: torch.Tensor, w: torch.Tensor, block_k: int | None) -> bool:
    """Whether fp8_linear runs torch._scaled_mm: CUDA that computes in fp8 (sm89+), per-channel scales, 16-aligned
    K and N, 16-bit output."""
    return (x.is_cuda and _fp8_device(x.device.index) and block_k is None
            and x.dtype in (torch.bfloat16, torch.float16) and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0)


def blockwise_ok(x: torch.Tensor, w: torch.Tensor, block_k: int | None, block_n: int | None) -> bool:
    """Whether fp8_linear runs cuBLAS's block-scaled GEMM (blockwise_mm): [128, 128] blocks whose rows share their
    scale row (block_n 128: the layer's slices start on block boundaries), an sm90 GPU (the only one torch runs it
    on) and a torch with F.scaled_mm, 16-aligned N and K, K blocks a multiple of 4 (cuBLAS wants the weight scales'
    rows 16-byte aligned), 16-bit output, the Triton quantization kernel on."""
    return (block_k == 128 and block_n == 128 and x.is_cuda and hasattr(torch.nn.functional, "scaled_mm")
            and _sm90(x.device.index) and x.dtype in (torch.bfloat16, torch.float16) and w.shape[0] % 16 == 0
            and w.shape[1] % 16 == 0 and -(-w.shape[1] // 128) % 4 == 0 and use_kernels(x))


@lru_cache(maxsize=None)
def _sm90(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def blockwise_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [N, K]^T with [128, 128]-block scales in the layers' layout (scale [N, K / 128], each block's
    row repeated on its 128 rows) through F.scaled_mm: activations quantized per (token, 128 columns), rows padded
    to a multiple of 4 as cuBLAS asks."""
    from tp_lora.ops.triton.fp8_quant import quantize_per_group as quantize  # noqa: PLC0415 - CUDA only
    f = torch.nn.functional
    xq, xs = quantize(x, 128, rows_to=4)
    out = f.scaled_mm(xq, w.t(), xs, f.ScalingType.BlockWise1x128, scale[::128].contiguous().t(),
                      f.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    return out[:x.shape[0]]


def takes_rows8(x: torch.Tensor, w: torch.Tensor, block_k: int | None, group: int | None = None) -> bool:
    """Whether fp8_linear(x, w, ..., x8) reads x8, activations x [T, K] quantized per token by their producer (x:
    any tensor of the activations' rows, dtype and device): per-channel weights and 16-bit x, up to ACT8_ROWS rows
    on the decode GEMM (its XQ form), past the weight-only rows through torch._scaled_mm. group: x8 quantized per
    (token, group columns) instead, as ACT8 quantizes: where the decode GEMM runs ACT8 with K tiles of that width."""
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    if group is not None:
        return (group == ACT8_GROUP and 0 < rows <= ACT8_ROWS and kernels_take(x, block_k) and act8_takes(x, block_k)
                and (block_k is None or block_k % group == 0))
    if block_k is not None or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    kernels = kernels_take(x, None)
    if kernels and 0 < rows <= ACT8_ROWS:
        return True
    return scaled_mm_ok(x, w, None) and kernels and rows > small_rows(w)


def empty_rows8(x: torch.Tensor, n: int | None = None, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers (q [T, n] e4m3, scales [T, groups] float32) for the T rows of x quantized per token (groups 1) or per
    (token, n / groups columns) (n: x's columns), the out8 of an op that feeds a layer taking them (takes_rows8)."""
    t = x.reshape(-1, x.shape[-1]).shape[0]
    return (torch.empty(t, n or x.shape[-1], dtype=FP8_DTYPE, device=x.device),
            torch.empty(t, groups, dtype=torch.float32, device=x.device))


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block_k: int | None,
               block_n: int | None = None, x8: Rows8 | None = None, sums: bool = False) -> torch.Tensor | SplitSums:
    """block_n: rows per block whose rows share one scale row (the layer's slices start on block boundaries),
    None where they may not. x8: x quantized per token (q [T, K] e4m3, scales [T, 1]) or per (token, K / G
    columns) (scales [T, G], G > 1) by the op that made it, read where takes_rows8 says so (else x is). sums: the
    decode GEMM may leave its output as its K shares' partial sums (SplitSums), for a reader that adds them."""
    rows = x.shape[0]
    group = None if x8 is None or x8[1].shape[-1] == 1 else x.shape[-1] // x8[1].shape[-1]
    x8 = x8 if x8 is not None and takes_rows8(x, w, block_k, group) else None
    # 16-bit activations are quantized to fp8 (W8A8): per token by their producer (x8), else per (row, 128 columns)
    # inside the decode GEMM up to ACT8_ROWS rows, past them by a kernel of their own; float32 layers ask for the
    # dequantized weights' exact product.
    half = x.dtype in (torch.bfloat16, torch.float16)
    small = small_rows(w, block_k)
    if rows and kernels_take(x, block_k):
        from tp_lora.ops.triton import fp8_gemm, fp8_quant  # noqa: PLC0415 - CUDA / forced only
        from tp_lora.ops.triton.configs import num_sms  # noqa: PLC0415
        if x8 is not None and group is not None:  # ACT8 of rows quantized per (token, K tile) by their producer
            return fp8_gemm.w8a16_mm(x8[0], w, scale, block_k, fp8_gemm.w8a16_config(rows, *w.shape, g8=True),
                                     x8[1], x.dtype, sums=sums)
        if x8 is not None and rows <= ACT8_ROWS:
            cfg = fp8_gemm.w8a16_config(rows, *w.shape, xq=True, sms=num_sms(w.device.index))
            return fp8_gemm.w8a16_mm(x8[0], w, scale, None, cfg, x8[1], x.dtype, sums=sums)
        if rows <= ACT8_ROWS and act8_takes(x, block_k):
            return fp8_gemm.w8a16_mm(x, w, scale, block_k, fp8_gemm.w8a16_config(rows, *w.shape, act8=True),
                                     sums=sums)
        if rows <= small:
            return fp8_gemm.w8a16_mm(x, w, scale, block_k, fp8_gemm.w8a16_config(rows, *w.shape), sums=sums)
        if half and block_k is not None:
            if blockwise_ok(x, w, block_k, block_n):
                return blockwise_mm(x, w, scale)
            xq, xs = fp8_quant.quantize_per_group(x, block_k)
            return fp8_gemm.w8a8_mm(xq, xs, w, scale, block_k, x.dtype)
    if rows and scaled_mm_ok(x, w, block_k):
        if x8 is not None:
            xq, xs = x8
        elif use_kernels(x):
            from tp_lora.ops.triton.fp8_quant import quantize_per_token as quantize  # noqa: PLC0415
            xq, xs = quantize(x)
        else:
            xq, xs = quantize_per_token(x)
        return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype,
                                use_fast_accum=True)
    return x @ dequantize(w, scale, block_k).to(x.dtype).t()
