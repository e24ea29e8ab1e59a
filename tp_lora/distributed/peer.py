"""Collectives over NVLink peer memory (PyTorch symmetric memory): the tp group's all-reduce by our Triton kernel
(tp_lora.distributed.peer_kernels) up to ours_max_bytes, its two-shot form up to two_shot_max_bytes, PyTorch's
two-shot kernel above, an all-gather, and the exchange a kernel fusing the all-reduce with what follows it
(tp_lora.ops.triton.peer_norm) is built on.

Our kernels push and poll the data itself (a Lamport-style exchange: no flags, no fences): program p of rank i
writes its share of the message into slot i of every rank's staging buffer (posted NVLink stores; a -0.0 is sent as
+0.0), then reads the slots of its own buffer with volatile loads until no element holds -0.0's bits, the empty mark
every element holds until pushed, and marks what it read empty again. A call in which a rank takes more than
POLL_MAX_BYTES exchanges by flags instead (the two-shot all-reduce always polls): each program, once its pushes are
done, sets its flag in every rank's signal pad to the call's number (a release store at system scope) and waits
for every rank's (acquire loads), then reads and marks empty as above. Every wait has a deadline, the group's
collective timeout: past it the kernel writes what it waited for into page-locked report words (PeerReport) and
traps, so a peer that died, stalled or skipped a call fails the device with an error the host names
(distributed.CollectiveTimeout) instead of spinning for ever. Calls alternate between the two halves of the
buffer, so a rank writes into a half only after every rank has started the next call, hence finished reading (and
emptying) that half. The call numbers live in device memory (`epochs`, per program), so CUDA graphs replay the
exchange; every kernel over the buffer launches the same fixed number of programs, so every program of every rank
counts the same calls. Never NVLink multicast (multimem): only peer loads and stores.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

# Messages the peer all-reduce takes (bytes), NCCL above: our kernels up to two_shot_max_bytes(ranks), PyTorch's
# two-shot above (BENCHMARKS.md, issue 36; inside CUDA graphs at 2 and 4 ranks).
PEER_MAX_BYTES = 8 << 20
PEER_DTYPES = (torch.bfloat16, torch.float32)  # what the symmetric-memory kernels reduce


def gather_max_bytes(ranks: int) -> int:
    """The largest all-gather output (bytes) the peer kernel takes, NCCL above: where NCCL overtakes it in a CUDA
    graph (BENCHMARKS.md, issue 36)."""
    return 8 << 20 if ranks <= 2 else 4 << 20


def ours_max_bytes(ranks: int) -> int:
    """The largest all-reduce our kernel takes (peer_kernels.all_reduce): where PyTorch's two-shot overtakes it."""
    return 512 << 10 if ranks <= 2 else 256 << 10


def two_shot_max_bytes(ranks: int) -> int:
    """The largest all-reduce the two-shot form of our kernel takes, PyTorch's two-shot above (BENCHMARKS.md, issue
    36); at 2 ranks our one-shot kernel's limit: the two-shot form is not used there."""
    return ours_max_bytes(ranks) if ranks <= 2 else 1 << 20


def fused_max_bytes(ranks: int) -> int:
    """The largest message our fused all-reduce + norm kernel takes: where it beats the all-reduce + norm at 2 ranks;
    our all-reduce's limit at more."""
    return 1 << 20 if ranks <= 2 else ours_max_bytes(ranks)


# The most bytes a rank takes in one call by polling the data; above, by flags after the pushes: a bandwidth-bound
# call pays more for the polling's volatile loads than for a flag's round trip (BENCHMARKS.md, issue 36).
POLL_MAX_BYTES = 1 << 20
PEER_PROGRAMS = 32  # programs of every kernel over a staging buffer (decode rows: one each)
# dtype -> (integer view, -0.0's bits in it): the empty mark of a staging buffer's elements
EMPTY = {torch.bfloat16: (torch.int16, -0x8000), torch.float32: (torch.int32, -0x80000000)}
RECENT_LAUNCHES = 6  # kernels per staging buffer a failure report lists (PeerBuffer.launches)


@dataclass
class PeerBuffer:
    """One symmetric staging buffer as a Triton kernel sees it: ptrs / pads are int64 tensors on the device holding
    every rank's buffer / signal pad address (rank order); epochs: int32 [2 * programs], each program's calls entered
    so far, then each program's calls finished;
    the buffer is 2 halves x world slots of `slot` elements, a rank's message at most one slot. A wait for a peer
    longer than `limit` ns gives up: what it waited for goes into `report`'s words (page-locked host memory) and the
    kernel traps (on CUDA; the interpreter never waits)."""
    ptrs: torch.Tensor
    pads: torch.Tensor
    epochs: torch.Tensor
    rank: int
    world: int
    programs: int
    slot: int
    report: "PeerReport"
    limit: int
    launched: int = 0  # kernels launched over this buffer from Python (a CUDA graph's once, at its capture)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_LAUNCHES))

    def launch(self, kind: str, t: torch.Tensor) -> None:
        """Count a kernel over this buffer about to launch (kind, its input t), for failure reports."""
        self.launched += 1
        self.recent.append((self.launched, kind, tuple(t.shape)))

    def launches(self) -> str:
        """The count and the last kernels launched over this buffer: (call number, kind, input shape)."""
        return f"{self.launched} launched (last: " + ", ".join(f"#{n} {kind} {list(shape)}"
                                                             for n, kind, shape in self.recent) + ")"

    def progress(self, wait_s: float = 2.0) -> str:
        """The calls the device's programs have entered and finished over this buffer (epochs; "a-b": fewest to
        most), read on a stream of its own beside whatever the device runs: where a busy device stands."""
        got = self._epochs(wait_s)
        if got is None:
            return "? (not readable)"
        spans = ["-".join(map(str, sorted({min(c), max(c)}))) for c in (got[:self.programs], got[self.programs:])]
        return f"entered {spans[0]}, finished {spans[1]}"

    def _epochs(self, wait_s: float) -> list[int] | None:
        """The epochs on the host; None when not read within wait_s, or the device has failed."""
        if not self.epochs.is_cuda:
            return self.epochs.tolist()
        try:
            host = torch.empty(self.epochs.shape, dtype=self.epochs.dtype, pin_memory=True)
            stream = torch.cuda.Stream(self.epochs.device)
            with torch.cuda.stream(stream):
                host.copy_(self.epochs, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            deadline = time.monotonic() + wait_s
            while not done.query():
                if time.monotonic() > deadline:
                    return None
                time.sleep(1e-3)
        except RuntimeError:
            return None
        return host.tolist()

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() <= self.slot

    def polls(self, received: int) -> bool:
        """Whether a call in which a rank takes `received` bytes from the slots exchanges by polling the data."""
        return received <= POLL_MAX_BYTES


class PeerReport:
    """The words a peer kernel that gave up waiting writes before it traps, [1, the rank it waited for, the call's
    number, the program, 0], or that a long wait notes, [2, .., the milliseconds waited so far]: in page-locked host
    memory the device writes at the same address (unified addressing), readable once the device has failed."""

    def __init__(self, device: torch.device):
        self.words = torch.zeros(5, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")
        self.address = self.words.data_ptr()  # what the kernels take

    def failure(self, rank: int, timeout_s: float, dtype: torch.dtype) -> str | None:
        """What a kernel of this rank over the staging buffer of `dtype` gave up on (or still waited for), or None."""
        state, peer, call, program, waited_ms = self.words.tolist()
        where = f"peer-memory collective call {call} (program {program}) over the {str(dtype).split('.')[-1]} buffer"
        if state == 2:  # a note (peer_kernels.note_wait): still waiting when the device failed
            return (f"rank {rank} of the group was waiting for rank {peer}'s data in {where} when its device failed "
                    f"(for {waited_ms / 1e3:g}s at least; parallel.timeout_s={timeout_s:g}s)")
        if not state:
            return None
        return (f"rank {rank} of the group waited more than parallel.timeout_s={timeout_s:g}s for rank {peer}'s data "
                f"in {where}: that rank died, stalled or skipped the call")


class PeerAllReduce:
    """Sum over one NCCL group through PyTorch symmetric memory (torch.distributed._symmetric_memory): our kernel
    over `staging` (the exchange above) up to ours_max, its two-shot form up to two_shot_max (>= ours_max); above,
    PyTorch's two-shot kernel (each rank reduces its 1/n share of every peer's buffer and writes it to every peer).
    One buffer of max_bytes per dtype for PyTorch's kernel and one staging buffer per dtype (signal pads of its own)
    for ours (all_reduce, all_gather, the fused reduce + norm), allocated and exchanged here (collective), so calls
    allocate nothing and capture in CUDA graphs."""

    def __init__(self, pg, device: torch.device | str, timeout_s: float, max_bytes: int = PEER_MAX_BYTES):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        device = torch.device(device)
        if symm_mem.get_backend(device) is None:
            symm_mem.set_backend("CUDA")  # peer mappings through the CUDA driver, not NVSHMEM
        self.name, self.max_bytes, self.timeout_s = pg.group_name, max_bytes, timeout_s
        self.bufs = {dt: symm_mem.empty(max_bytes // dt.itemsize, dtype=dt, device=device) for dt in PEER_DTYPES}
        for buf in self.bufs.values():
            symm_mem.rendezvous(buf, self.name)
        self.staging = {}
        world = pg.size()
        self.fused_max = fused_max_bytes(world)
        self.gather_max = gather_max_bytes(world)
        self.ours_max = ours_max_bytes(world)
        self.two_shot_max = two_shot_max_bytes(world)
        slot_bytes = max(self.fused_max, self.gather_max // world, self.ours_max, 2 * self.two_shot_max // world)
        for dt in PEER_DTYPES:
            buf = symm_mem.empty(2 * world * slot_bytes // dt.itemsize, dtype=dt, device=device)
            hdl = symm_mem.rendezvous(buf, self.name)
            if PEER_PROGRAMS * world > hdl.signal_pad_size // 4:
                raise ValueError(f"a signal pad of {hdl.signal_pad_size} bytes holds no {PEER_PROGRAMS} x {world} "
                                 "flags")
            off = getattr(hdl, "offset", 0)  # the tensor's place in its allocation (0 from symm_mem.empty)
            ptrs = torch.tensor([p + off for p in hdl.buffer_ptrs], dtype=torch.int64, device=device)
            pads = torch.tensor(hdl.signal_pad_ptrs, dtype=torch.int64, device=device)
            epochs = torch.zeros(2 * PEER_PROGRAMS, dtype=torch.int32, device=device)
            buf.view(EMPTY[dt][0]).fill_(EMPTY[dt][1])
            self.staging[dt] = (buf, PeerBuffer(ptrs, pads, epochs, hdl.rank, world, PEER_PROGRAMS,
                                                slot_bytes // dt.itemsize, PeerReport(device), int(timeout_s * 1e9)))
        torch.cuda.synchronize(device)
        index = torch.cuda.current_device() if device.index is None else device.index
        dist.barrier(group=pg, device_ids=[index])  # every buffer marked empty before any rank pushes

    def failure(self) -> str | None:
        """Why a kernel over this group's buffers gave up waiting for a peer (PeerReport), or None."""
        return next((w for dt, (_, b) in self.staging.items() if (w := b.report.failure(b.rank, self.timeout_s, dt))),
                    None)

    def takes(self, t: torch.Tensor) -> bool:
        return t.is_cuda and t.dtype in self.bufs and t.is_contiguous() and 0 < t.nbytes <= self.max_bytes

    def takes_fused(self, t: torch.Tensor) -> bool:
        """Whether t's reduce is fused into the kernel that consumes it (tp_lora.ops.triton.peer_norm)."""
        return t.is_cuda and t.dtype in self.staging and 0 < t.nbytes <= self.fused_max

    def buffer(self, dtype: torch.dtype) -> PeerBuffer:
        return self.staging[dtype][1]

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the group, in place: up to ours_max by our kernel (peer_kernels.all_reduce), then up to
        two_shot_max by its two-shot form, above by PyTorch's (two_shot)."""
        if t.nbytes <= self.two_shot_max:
            from tp_lora.distributed.peer_kernels import all_reduce  # noqa: PLC0415 - Triton only where the path is
            return all_reduce(t, self.buffer(t.dtype), two_shot=t.nbytes > self.ours_max)
        return self.two_shot(t)

    def two_shot(self, t: torch.Tensor) -> torch.Tensor:
        """t summed in place by PyTorch's two-shot kernel: copied into the buffer padded to whole 16-byte vectors,
        reduced there and copied back."""
        n, size = t.numel(), t.element_size()
        flat, buf = t.view(-1), self.bufs[t.dtype]
        buf[:n].copy_(flat)
        torch.ops.symm_mem.two_shot_all_reduce_(buf[:-(-n * size // 16) * 16 // size], "sum", self.name)
        flat.copy_(buf[:n])
        return t

    def takes_gather(self, t: torch.Tensor, world: int) -> bool:
        return t.is_cuda and t.dtype in self.staging and 0 < t.nbytes * world <= self.gather_max

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's t concatenated along dim 0 or the last dim (rank order), by one kernel."""
        from tp_lora.distributed.peer_kernels import all_gather  # noqa: PLC0415 - Triton only where the path is
        return all_gather(t, dim, self.buffer(t.dtype))
