"""The Triton side of the peer-memory collectives (tp_lora.distributed.peer, whose docstring gives the protocol):
next_call / push_row / exchange / take_row, which a peer kernel is built from, the all-reduce and the
all-gather.
Imported only where the peer path runs (CUDA, or a test under TRITON_INTERPRET=1 with a group of one)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

GATHER_BLOCK = 2048  # elements per program and step of the all-gather kernel
REDUCE_BLOCK = 2048  # elements per program and step of the all-reduce kernel
NOTE_AFTER = tl.constexpr(8)  # a wait past its deadline / NOTE_AFTER leaves a note in the report words (note_wait)
# PTX release stores / acquire loads for the flags; the interpreter (no PTX) takes atomics of the same semantics.
ASM = os.environ.get("TRITON_INTERPRET") != "1"


def all_gather(t: torch.Tensor, dim: int, buf) -> torch.Tensor:
    """t [.., rows, cols] viewed as rows of its last dim; dim 0 (of a 2-dim t) or the last: the output's layout;
    buf: the group's staging buffer of t's dtype (tp_lora.distributed.peer.PeerBuffer)."""
    x = t.reshape(-1, t.shape[-1]) if t.dim() != 1 else t.view(1, -1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    last = dim % t.dim() == t.dim() - 1
    if not last and (t.dim() != 2 or dim % 2 != 0):
        raise ValueError(f"peer all_gather: dim {dim} of a {t.dim()}-dim tensor (expected the first of 2 or the last)")
    if not buf.fits(x):
        raise ValueError(f"peer all_gather: {rows} x {cols} elements exceed a slot of {buf.slot}")
    shape = list(t.shape)
    shape[dim % t.dim()] *= buf.world
    out = torch.empty(shape, dtype=t.dtype, device=t.device)
    # out[row, rank * cols + c] (last dim) or out[rank * rows + row, c] (dim 0)
    s_row, s_rank = (buf.world * cols, cols) if last else (cols, rows * cols)
    buf.launch("all_gather", x)
    _all_gather_kernel[(buf.programs,)](
        x, out, buf.ptrs, buf.pads, buf.epochs, buf.report.address, buf.limit, rows, cols, x.stride(0), s_row, s_rank,
        buf.slot, RANK=buf.rank, WORLD=buf.world, BLOCK=GATHER_BLOCK, ASM=ASM, POLL=buf.polls(out.nbytes))
    return out


def all_reduce(t: torch.Tensor, buf, two_shot: bool = False) -> torch.Tensor:
    """t (contiguous) summed over the ranks in place, in rank order in float32 (every rank gets the same bits), by
    one kernel. One-shot (t up to a slot): each program pushes its blocks of t to every rank, then sums every rank's
    copy of them as they arrive. two_shot (two chunks of t / world up to a slot; always polling): rank j sums chunk
    j of every rank's t and pushes the sum to every rank, which collects the chunks (each rank takes 2 (world - 1) /
    world of t, not world - 1 times t). buf: the group's staging buffer of t's dtype."""
    if not t.is_contiguous():
        raise ValueError(f"peer all_reduce: a contiguous tensor expected, got strides {t.stride()}")
    n = t.numel()
    chunk = -(-n // buf.world)
    if (2 * chunk if two_shot else n) > buf.slot:
        raise ValueError(f"peer all_reduce: {n} elements exceed a slot of {buf.slot}"
                         + (f" in two chunks of {chunk}" if two_shot else ""))
    if n:
        buf.launch("all_reduce two-shot" if two_shot else "all_reduce", t)
    if n and two_shot:
        _all_reduce_two_shot_kernel[(buf.programs,)](t, buf.ptrs, buf.epochs, buf.report.address, buf.limit, n, chunk,
                                                     buf.slot, RANK=buf.rank, WORLD=buf.world, BLOCK=REDUCE_BLOCK,
                                                     ASM=ASM)
    elif n:
        _all_reduce_kernel[(buf.programs,)](t, buf.ptrs, buf.pads, buf.epochs, buf.report.address, buf.limit, n,
                                            buf.slot, RANK=buf.rank, WORLD=buf.world, BLOCK=REDUCE_BLOCK, ASM=ASM,
                                            POLL=buf.polls(t.nbytes * buf.world))
    return t


@triton.jit
def next_call(epochs, program, slot, WORLD: tl.constexpr):
    """This program's call number e (counted as entered in epochs[program]) and the offset (elements) of the half it
    uses."""
    e = tl.load(epochs + program) + 1
    tl.debug_barrier()  # every thread has read the count before one stores it
    tl.store(epochs + program, e)
    return e, (e % 2).to(tl.int64) * WORLD * slot


@triton.jit
def done_call(epochs, program, e):
    """Count call e as finished by this program (epochs[programs + program]), once every thread's work is done."""
    tl.debug_barrier()
    tl.store(epochs + tl.num_programs(0) + program, e)


@triton.jit
def clock(x, ASM: tl.constexpr):
    """The GPU's global timer (ns); 0 under the interpreter, where no wait has a deadline (a group of one never
    waits). x: any int32 scalar (the inline assembly's operand)."""
    if ASM:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False,
                                      pack=1)
    else:
        t = x.to(tl.int64) * 0
    return t


@triton.jit
def put_word(at, value):
    """An int32 `value` into host memory at address `at` (int64), stored by every thread that runs it: a scalar
    tl.store is left to the program's first thread, whose warp may not be the one waiting."""
    tl.inline_asm_elementwise("st.volatile.global.u32 [$1], $2;\n mov.u32 $0, 0;", "=r,l,r", [at, value],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def give_up(report, r, e, program, ASM: tl.constexpr):
    """A wait past its deadline (a peer that never pushed: it died, stalled or skipped the call): [1, the rank waited
    for, the call's number, the program] into the report words (page-locked host memory at address `report`, which
    the host reads once the device fails), then a trap: the device's work fails with an error instead of spinning."""
    if ASM:
        put_word(report + 4, e * 0 + r)
        put_word(report + 8, e)
        put_word(report + 12, e * 0 + program)
        put_word(report, e * 0 + 1)
        tl.inline_asm_elementwise("membar.sys;\n trap;\n mov.u32 $0, 0;", "=r,r", [e], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def note_wait(report, r, e, program, waited, ASM: tl.constexpr):
    """A wait past 1 / NOTE_AFTER of its deadline, `waited` ns so far: [2, the rank waited for, the call's number, the
    program, waited ms] into the report words, unless a kernel gave up already; no trap. A rank whose device fails
    because a peer gave up first (its mappings of that peer's memory die with it) still tells what it waited for."""
    if ASM:
        if tl.load(report.to(tl.pointer_type(tl.int32)), volatile=True) != 1:
            put_word(report + 4, e * 0 + r)
            put_word(report + 8, e)
            put_word(report + 12, e * 0 + program)
            put_word(report + 16, (waited // 1000000).to(tl.int32))
            put_word(report, e * 0 + 2)
            tl.inline_asm_elementwise("membar.sys;\n mov.u32 $0, 0;", "=r,r", [e], dtype=tl.int32, is_pure=False,
                                      pack=1)  # out to host memory now, not when the kernel ends


@triton.jit
def push_to(ptrs, r, at, values, ok):
    """values (masked by ok) into rank r's buffer at element offsets `at`; a -0.0 goes as +0.0 (-0.0's bits mark an
    empty element: take_row)."""
    base = tl.multiple_of(tl.load(ptrs + r).to(tl.pointer_type(values.dtype)), 16)  # symm_mem: page aligned
    tl.store(base + at, tl.where(unset(values), tl.zeros_like(values), values), mask=ok)


@triton.jit
def push_row(ptrs, half, slot, offset, i, values, ok, RANK: tl.constexpr, WORLD: tl.constexpr):
    """values (at columns i, masked by ok) into slot RANK of the half of every rank's buffer, at `offset`."""
    for r in tl.static_range(WORLD):
        push_to(ptrs, r, half + RANK * slot + offset + i, values, ok)


@triton.jit
def publish(pads, program, e, RANK: tl.constexpr, WORLD: tl.constexpr, ASM: tl.constexpr):
    """Tell every rank that this program's pushes of call e are done: after a block barrier (every thread's stores
    before it), flag [program * WORLD + RANK] of every rank's pad set to e by a release store at system scope."""
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        flag = tl.load(pads + r) + 4 * (program * WORLD + RANK)
        if ASM:
            tl.inline_asm_elementwise("st.release.sys.global.u32 [$1], $2;\n mov.u32 $0, 0;", "=r,l,r", [flag, e],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.atomic_xchg(flag.to(tl.pointer_type(tl.int32)), e, sem="release", scope="sys")


@triton.jit
def wait_flag(flag, e, limit):
    """Spin (acquire loads at system scope) until the flag at address `flag` has reached call e (a wrapping
    difference: a rank may be one call ahead) or `limit` ns have passed; -> the flag's last value."""
    return tl.inline_asm_elementwise(
        """{
        .reg .u32 %t;
        .reg .s32 %d;
        .reg .u64 %t0, %t1;
        .reg .pred %p;
        mov.u64 %t0, %globaltimer;
        wait_flag:
        ld.acquire.sys.global.u32 %t, [$1];
        sub.s32 %d, %t, $2;
        setp.ge.s32 %p, %d, 0;
        @%p bra flag_in;
        mov.u64 %t1, %globaltimer;
        sub.u64 %t1, %t1, %t0;
        setp.lt.u64 %p, %t1, $3;
        @%p bra wait_flag;
        flag_in:
        mov.u32 $0, %t;
        }""", "=r,l,r,l", [flag, e, limit], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_peers(pads, program, e, report, limit, RANK: tl.constexpr, WORLD: tl.constexpr, ASM: tl.constexpr):
    """Spin (every thread, acquire loads at system scope) until every rank's flag for this program in this rank's
    pad has reached call e; past limit / NOTE_AFTER ns of waiting for one, note_wait, past `limit`, give_up."""
    mine = tl.load(pads + RANK) + 4 * program * WORLD
    for r in tl.static_range(WORLD):
        if not ASM:
            while tl.atomic_add((mine + 4 * r).to(tl.pointer_type(tl.int32)), 0, sem="acquire", scope="sys") - e < 0:
                pass
        else:
            first = limit // NOTE_AFTER
            if wait_flag(mine + 4 * r, e, first) - e < 0:
                note_wait(report, r, e, program, first, ASM)
                if wait_flag(mine + 4 * r, e, limit - first) - e < 0:
                    give_up(report, r, e, program, ASM)


@triton.jit
def empty_mark(v):
    """-0.0's bits in v's dtype (float32 / 16-bit floats), shaped like v: what an element holds until pushed."""
    if v.dtype.primitive_bitwidth == 16:  # resolved at compile time: one branch is compiled
        mark = tl.full(v.shape, 0x8000, tl.uint16).to(v.dtype, bitcast=True)
    else:
        mark = tl.full(v.shape, 0x80000000, tl.uint32).to(v.dtype, bitcast=True)
    return mark


@triton.jit
def unset(v):
    """Whether each element of v still holds the empty mark."""
    if v.dtype.primitive_bitwidth == 16:
        empty = v.to(tl.uint16, bitcast=True) == 0x8000
    else:
        empty = v.to(tl.uint32, bitcast=True) == 0x80000000
    return empty


@triton.jit
def take_row(ptrs, half, slot, offset, i, ok, r, report, limit, e, program, RANK: tl.constexpr, DT: tl.constexpr,
             POLL: tl.constexpr, ASM: tl.constexpr):
    """Rank r's pushed values at `offset` of this rank's buffer (columns i, masked by ok; 0 elsewhere), marked empty
    again once read. POLL: volatile loads until no element holds the empty mark (else the flags said they are in);
    past `limit` ns of polling, give_up (call e, this program). Where i has fewer elements than the program has
    threads, warps hold copies of the same elements and each ends its polling on its own copy: the barrier before
    marking them empty keeps a warp from emptying what another still waits to see."""
    base = tl.multiple_of(tl.load(ptrs + RANK).to(tl.pointer_type(DT)), 16)
    at = base + half + r * slot + offset + i
    if POLL:
        v = tl.load(at, mask=ok, other=0.0, volatile=True)
        t0 = e.to(tl.int64) * 0  # the clock is read only once the values were not all in
        while tl.sum(tl.where(ok & unset(v), 1, 0)) > 0:
            v = tl.load(at, mask=ok, other=0.0, volatile=True)
            now = clock(e, ASM)
            t0 = tl.where(t0 == 0, now, t0)
            if now - t0 > limit:
                give_up(report, r, e, program, ASM)
            elif now - t0 > limit // NOTE_AFTER:
                note_wait(report, r, e, program, now - t0, ASM)
    else:
        v = tl.load(at, mask=ok, other=0.0)
    tl.debug_barrier()
    tl.store(at, empty_mark(v), mask=ok)
    return v


@triton.jit
def exchange(pads, program, e, report, limit, RANK: tl.constexpr, WORLD: tl.constexpr, ASM: tl.constexpr,
             POLL: tl.constexpr):
    """Between a program's pushes and its take_row calls: nothing when polling, else publish + wait_peers."""
    if not POLL:
        publish(pads, program, e, RANK, WORLD, ASM)
        wait_peers(pads, program, e, report, limit, RANK, WORLD, ASM)


@triton.jit
def _all_gather_kernel(x_ptr, out_ptr, ptrs, pads, epochs, report, limit, rows, cols, s_x, s_row, s_rank, slot,
                       RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr,
                       POLL: tl.constexpr):
    p = tl.program_id(0)
    step = tl.num_programs(0)
    dt = out_ptr.dtype.element_ty
    e, half = next_call(epochs, p, slot, WORLD)
    chunks = tl.cdiv(cols, BLOCK)
    for u in range(p, rows * chunks, step):
        row, c = tl.cast(u // chunks, tl.int64), (u % chunks) * BLOCK + tl.arange(0, BLOCK)
        ok = c < cols
        push_row(ptrs, half, slot, row * cols, c, tl.load(x_ptr + row * s_x + c, mask=ok), ok, RANK, WORLD)
    exchange(pads, p, e, report, limit, RANK, WORLD, ASM, POLL)
    for u in range(p, rows * chunks, step):
        row, c = tl.cast(u // chunks, tl.int64), (u % chunks) * BLOCK + tl.arange(0, BLOCK)
        ok = c < cols
        for r in tl.static_range(WORLD):
            got = take_row(ptrs, half, slot, row * cols, c, ok, r, report, limit, e, p, RANK, dt, POLL, ASM)
            tl.store(out_ptr + row * s_row + r * s_rank + c, got, mask=ok)
    done_call(epochs, p, e)


@triton.jit
def _all_reduce_kernel(x_ptr, ptrs, pads, epochs, report, limit, n, slot, RANK: tl.constexpr, WORLD: tl.constexpr,
                       BLOCK: tl.constexpr, ASM: tl.constexpr, POLL: tl.constexpr):
    p = tl.program_id(0)
    step = tl.num_programs(0)
    dt = x_ptr.dtype.element_ty
    e, half = next_call(epochs, p, slot, WORLD)
    for u in range(p, tl.cdiv(n, BLOCK), step):
        c = tl.cast(u, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = c < n
        push_row(ptrs, half, slot, 0, c, tl.load(x_ptr + c, mask=ok), ok, RANK, WORLD)
    exchange(pads, p, e, report, limit, RANK, WORLD, ASM, POLL)
    for u in range(p, tl.cdiv(n, BLOCK), step):
        c = tl.cast(u, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = c < n
        h = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            h += take_row(ptrs, half, slot, 0, c, ok, r, report, limit, e, p, RANK, dt, POLL, ASM).to(tl.float32)
        tl.store(x_ptr + c, h.to(dt), mask=ok)
    done_call(epochs, p, e)


@triton.jit
def _all_reduce_two_shot_kernel(x_ptr, ptrs, epochs, report, limit, n, chunk, slot, RANK: tl.constexpr,
                                WORLD: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    """Chunk j = x[j * chunk:(j + 1) * chunk]. Program p takes blocks u = p, p + programs, .. of every chunk: pushes
    block u of chunk j into slot RANK of rank j (at 0), sums block u of its own chunk over the ranks and pushes the
    sum into slot RANK of every rank (at chunk), then writes every rank's summed block u into x."""
    p = tl.program_id(0)
    step = tl.num_programs(0)
    dt = x_ptr.dtype.element_ty
    e, half = next_call(epochs, p, slot, WORLD)
    blocks = tl.cdiv(chunk, BLOCK)
    for u in range(p, blocks, step):
        c = tl.cast(u, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        for j in tl.static_range(WORLD):
            ok = (c < chunk) & (j * chunk + c < n)
            push_to(ptrs, j, half + RANK * slot + c, tl.load(x_ptr + j * chunk + c, mask=ok), ok)
    for u in range(p, blocks, step):
        c = tl.cast(u, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = (c < chunk) & (RANK * chunk + c < n)
        h = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            h += take_row(ptrs, half, slot, 0, c, ok, r, report, limit, e, p, RANK, dt, True, ASM).to(tl.float32)
        push_row(ptrs, half, slot, chunk, c, h.to(dt), ok, RANK, WORLD)
    for u in range(p, blocks, step):
        c = tl.cast(u, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        for j in tl.static_range(WORLD):
            ok = (c < chunk) & (j * chunk + c < n)
            got = take_row(ptrs, half, slot, chunk, c, ok, j, report, limit, e, p, RANK, dt, True, ASM)
            tl.store(x_ptr + j * chunk + c, got, mask=ok)
    done_call(epochs, p, e)
