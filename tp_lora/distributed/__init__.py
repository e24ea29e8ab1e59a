"""Process groups and every collective the runtime performs.

Nothing else in tp_lora calls torch.distributed collectives: layers name the primitive they need, and the counters
here let tests and benchmarks read the communication of a forward pass in one place.

The mesh is (dp, tp): `tp` groups split layers; `dp` groups hold disjoint requests (and, for MoE, are the expert-
parallel groups). With one process nothing is initialised and every collective is the identity.

All-reduce of the tp group (parallel.allreduce): NCCL, or up to PEER_MAX_BYTES the peer-memory path over NVLink
(tp_lora.distributed.peer), lower latency than NCCL for a decode step's messages; it also gives the group's
all-gathers a peer kernel and fused_peer a buffer for kernels that fuse the reduce with what follows.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_lora.distributed.mesh import expert_mesh_groups, mesh_groups
from tp_lora.distributed.peer import (PEER_MAX_BYTES, PeerAllReduce, PeerBuffer, gather_max_bytes,  # noqa: F401
                                     ours_max_bytes)
from tp_lora.distributed.stats import CommStats


@dataclass
class Group:
    """A process group seen from one rank. `pg` is None for a group of one."""
    name: str
    rank: int = 0
    size: int = 1
    ranks: tuple[int, ...] = (0,)
    pg: object | None = None
    peer: PeerAllReduce | None = None  # the symmetric-memory all-reduce, where parallel.allreduce chose it
    host_pg: object | None = None  # gloo over the same ranks for per-step host exchanges (CUDA runs): no device wait


STATS = CommStats()

# torch 2.13 renamed the tensor-in, tensor-out collectives; older releases (the GPU image has 2.11) have the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, in place; returns t. Through peer memory where the group has it and t fits, else NCCL /
    gloo: the choice depends on t's size, dtype and layout alone, so every rank makes the same one."""
    if group.size == 1:
        return t
    STATS.record("all_reduce", group, t)
    if group.peer is not None and group.peer.takes(t):
        return group.peer.all_reduce(t)
    dist.all_reduce(t, group=group.pg)
    return t


def fused_peer(t: torch.Tensor, group: Group, scatter: bool = False) -> PeerBuffer | None:
    """The group's staging buffer for t's dtype where t's all-reduce (or reduce-scatter) is fused into the kernel
    that consumes it (tp_lora.ops.fused.reduce_add_rms_norm: up to fused_max_bytes), counted as the collective it
    is. None: all_reduce(t) / reduce_scatter(t) instead (the same choice on every rank)."""
    if group.size == 1 or group.peer is None or not group.peer.takes_fused(t):
        return None
    STATS.record("reduce_scatter" if scatter else "all_reduce", group, t)
    return group.peer.buffer(t.dtype)


def all_gather(t: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's t along dim (rank order). Through peer memory where the group has it (dim 0 of a
    2-dim t or the last dim, output up to gather_max_bytes), else NCCL / gloo."""
    if group.size == 1:
        return t
    STATS.record("all_gather", group, t)
    dim = dim % t.dim()
    if group.peer is not None and group.peer.takes_gather(t, group.size) and (dim == t.dim() - 1 or t.dim() == 2):
        return group.peer.all_gather(t, dim)
    out = torch.empty((group.size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    _all_gather_tensor(out, t.contiguous(), group=group.pg)
    if dim == 0:
        return out
    return torch.cat(out.chunk(group.size, 0), dim)


def reduce_scatter(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, then rank i keeps the i-th equal chunk of dim 0. Where the group has peer memory and t
    fits, t is all-reduced there in place (one kernel up to one-shot sizes: faster than NCCL's reduce-scatter at
    small messages) and the chunk is a view of it."""
    if group.size == 1:
        return t
    STATS.record("reduce_scatter", group, t)
    if group.peer is not None and group.peer.takes(t):
        return group.peer.all_reduce(t).chunk(group.size, 0)[group.rank]
    out = torch.empty((t.shape[0] // group.size,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    _reduce_scatter_tensor(out, t.contiguous(), group=group.pg)
    return out


ALLREDUCE_CHOICES = ("auto", "nccl", "symm_mem")


# Made once per process and reused by every later init_parallel / init_expert_parallel of the same ranks (a test
# process builds many layouts): NCCL communicators and peer buffers hold device memory that is only freed at
# shutdown(). Keys: ("pg", kind, ranks, timeout_s) -> process group; process group name -> its PeerAllReduce.
_GROUP_CACHE: dict[tuple, object] = {}
_PEERS: dict[str, PeerAllReduce] = {}
_PEER_GROUPS: list[Group] = []  # the Groups given a peer, which shutdown() takes back before freeing the buffers


def peer_access(group: Group, device: torch.device) -> str | None:
    """Why the group's ranks cannot reduce through peer memory, or None when they can: every rank on one host, each
    pair of its GPUs with P2P access. The same answer on every rank (all-gathers over the group)."""
    if device.type != "cuda":
        return f"the ranks run on {device.type}"
    uuids = all_gather_object((socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid)), group)
    if len({host for host, _ in uuids}) > 1:
        return "the group spans several hosts"
    local = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    peers = [local.get(u) for _, u in uuids if u != str(torch.cuda.get_device_properties(device).uuid)]
    bad = [p for p in peers if p is None or not torch.cuda.can_device_access_peer(device, p)]
    mine = f"cuda:{device.index} of rank {group.rank} has no P2P access to a peer's GPU" if bad else None
    return next((r for r in all_gather_object(mine, group) if r), None)


def use_allreduce(group: Group, device: torch.device, choice: str = "auto") -> str:
    """Set how the group's all_reduce runs (parallel.allreduce): nccl (NCCL on CUDA, gloo on CPU), symm_mem (peer
    memory up to PEER_MAX_BYTES, NCCL above; an error where the ranks lack peer access), auto (symm_mem where they
    have it, else nccl). Collective over the group; the group's first rank prints the choice. Returns the path."""
    if choice not in ALLREDUCE_CHOICES:
        raise ValueError(f"parallel.allreduce={choice!r}: expected one of {', '.join(ALLREDUCE_CHOICES)}")
    group.peer = None
    if group.size == 1:
        return "none"
    why_not = None if choice == "nccl" else peer_access(group, device)
    if choice == "symm_mem" and why_not:
        raise ValueError(f"parallel.allreduce=symm_mem needs peer memory between the tp group's GPUs, but {why_not}:"
                         f" use parallel.allreduce=auto or nccl")
    path = ("nccl" if device.type == "cuda" else "gloo") + (f" ({why_not})" if why_not else "")
    if choice != "nccl" and why_not is None:
        name = group.pg.group_name
        if name not in _PEERS:
            _PEERS[name] = PeerAllReduce(group.pg, device, _SETTINGS["timeout_s"])
        group.peer = _PEERS[name]
        _PEER_GROUPS.append(group)
        p = group.peer
        path = (f"symm_mem (ours up to {p.ours_max >> 10} KiB, two-shot up to {p.two_shot_max >> 10} KiB, PyTorch's "
                f"two-shot up to {PEER_MAX_BYTES >> 10} KiB, NCCL above; fused with the next norm up to "
                f"{p.fused_max >> 10} KiB; all-gathers up to {p.gather_max >> 10} KiB)")
    if group.rank == 0 and group.ranks[0] == 0:
        print(f"parallel.allreduce={choice}: {group.name} all-reduce over {group.size} ranks by {path}", flush=True)
    return "symm_mem" if group.peer is not None else "nccl"


class CollectiveTimeout(RuntimeError):
    """The device did not finish this rank's queued collectives within parallel.timeout_s: a peer died or stalled."""


# This process's collective settings, fixed by init_parallel: where object collectives stage their bytes (NCCL needs
# CUDA tensors) and how long a host wait on the device may take.
_SETTINGS = {"device": torch.device("cpu"), "timeout_s": 300.0}


def wait_device(device: torch.device) -> None:
    """Block until `device` has run everything queued so far, or raise CollectiveTimeout (see wait_event)."""
    if device.type != "cuda":
        return
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    wait_event(done, device)


def wait_event(done: torch.cuda.Event, device: torch.device) -> None:
    """Block until the recorded event `done` on `device` has passed, or raise CollectiveTimeout.

    NCCL collectives are asynchronous: a peer that never joins shows up as a device that never finishes, and a plain
    host sync (.tolist(), .cpu()) would then wait forever. Waiting on an event with a deadline turns that into an
    error the caller can report. Gloo collectives block and time out on their own, so CPU needs nothing."""
    start = time.monotonic()
    while not _done(done):
        waited = time.monotonic() - start
        if waited > _SETTINGS["timeout_s"]:
            raise CollectiveTimeout(f"collectives on {device} did not complete within parallel.timeout_s="
                                    f"{_SETTINGS['timeout_s']:g}s: a peer rank died or stalled "
                                    f"({last_calls(probe=True)})")
        time.sleep(0 if waited < 0.01 else 1e-3)  # spin through a normal step, then back off


def _done(event: torch.cuda.Event) -> bool:
    """event.query(); a device failed by a peer kernel that gave up waiting raises CollectiveTimeout saying why."""
    try:
        return event.query()
    except RuntimeError as e:
        why = peer_failure()
        if why is None:
            raise
        raise CollectiveTimeout(f"{why} ({last_calls()})") from e


def last_calls(probe: bool = False) -> str:
    """What this rank launched last, for a failure report: its last collectives (CommStats.recent) and per staging
    buffer the peer kernels launched (their count is what a peer kernel's call number follows, graph replays aside).
    probe (a device still running, not failed): also the calls its programs have entered and finished there."""
    def buffer(name, dt, buf):
        return (f"{name} {str(dt).split('.')[-1]}: {buf.launches()}"
                + (f", the device's programs {buf.progress()}" if probe else ""))
    counts = "; ".join(buffer(name, dt, buf) for name, p in _PEERS.items() for dt, (_, buf) in p.staging.items())
    return f"last collectives of this rank: {STATS.recent() or 'none'}" + (
        f"; peer kernels per staging buffer: {counts}" if counts else "")


def peer_failure() -> str | None:
    """Why a peer-memory kernel of this process gave up waiting for another rank (and so failed the device), or None:
    read from page-locked host memory, so it can be asked after any CUDA call failed (a kernel's load, a copy)."""
    return next((w for p in _PEERS.values() if (w := p.failure())), None)


def _host(t: torch.Tensor) -> torch.Tensor:
    wait_device(t.device)
    return t.cpu()


def _object_bytes(obj) -> torch.Tensor:
    """obj pickled, in a tensor of its own: a view of the Python bytes handed to gloo would let its worker thread
    drop the last reference to a Python object, which needs the GIL (an abort if the interpreter is exiting)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(_SETTINGS["device"], copy=True)


def broadcast_object(obj, group: Group, src_rank: int = 0):
    """Rank src_rank's Python object on every rank of the group (host-side control, not counted)."""
    if group.size == 1:
        return obj
    data = _object_bytes(obj) if group.rank == src_rank else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=_SETTINGS["device"])
    dist.broadcast(size, src=group.ranks[src_rank], group=group.pg)
    if data is None:
        data = torch.empty(int(_host(size)[0]), dtype=torch.uint8, device=_SETTINGS["device"])
    dist.broadcast(data, src=group.ranks[src_rank], group=group.pg)
    return pickle.loads(_host(data).numpy().tobytes())


def all_gather_object(obj, group: Group) -> list:
    """Every rank's Python object (rank order); host-side control, not counted."""
    if group.size == 1:
        return [obj]
    data = _object_bytes(obj)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=data.device)
    sizes = torch.empty(group.size, dtype=torch.int64, device=data.device)
    _all_gather_tensor(sizes, size, group=group.pg)
    sizes = _host(sizes).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=data.device)
    padded[:data.numel()] = data
    out = torch.empty(group.size * padded.numel(), dtype=torch.uint8, device=data.device)
    _all_gather_tensor(out, padded, group=group.pg)
    rows = _host(out).view(group.size, -1).numpy()
    return [pickle.loads(rows[i, :n].tobytes()) for i, n in enumerate(sizes)]


def all_true(flags: list[bool], group: Group) -> list[bool]:
    """Element-wise AND of every rank's flags (the same number on each): which of a common list of things hold on
    every rank. One small all-gather; host-side control, not counted."""
    if group.size == 1:
        return list(flags)
    mine = torch.tensor(flags, dtype=torch.uint8, device=_SETTINGS["device"])
    return _gathered(mine, group).all(dim=0).tolist()


def _gathered(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's 1-dim t (the same size on each), stacked [group.size, n] on the host."""
    out = torch.empty(group.size * t.numel(), dtype=t.dtype, device=t.device)
    _all_gather_tensor(out, t, group=group.pg)
    return _host(out).view(group.size, -1)


@dataclass
class ParallelState:
    """This rank's place in the (dp, tp) mesh. `world` spans all ranks.

    MoE layers add two groups (init_expert_parallel): `ep` splits the experts, `moe_tp` splits each expert's
    intermediate dim. `ep_attention` says where the EP group's tokens come from: "dp" = each EP rank is another DP
    replica with its own requests; "tp" = the EP group is the attention TP group and each rank routes a 1/tp chunk.
    """
    world: Group
    tp: Group
    dp: Group
    device: torch.device
    ep: Group | None = None  # None = no expert parallelism (a group of one)
    moe_tp: Group | None = None  # None = the attention tp group
    ep_attention: str = "dp"

    def __post_init__(self):
        if self.ep is None:
            self.ep = Group("ep")
        if self.moe_tp is None:
            self.moe_tp = self.tp

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def is_driver(self) -> bool:
        return self.world.rank == 0


def single_process(device: str | torch.device = "cpu") -> ParallelState:
    return ParallelState(world=Group("world"), tp=Group("tp"), dp=Group("dp"), device=torch.device(device))


def init_parallel(tp_size: int, device: str = "cpu", timeout_s: float = 300.0,
                  allreduce: str = "auto") -> ParallelState:
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    NCCL on CUDA, gloo on CPU; the tp group's all-reduce as parallel.allreduce says (use_allreduce). A collective
    that does not complete within timeout_s raises instead of hanging.
    """
    if allreduce not in ALLREDUCE_CHOICES:  # before any collective: every rank stops with the same message
        raise ValueError(f"parallel.allreduce={allreduce!r}: expected one of {', '.join(ALLREDUCE_CHOICES)}")
    world_size, rank, local_rank = (int(os.environ.get(k, d)) for k, d in (("WORLD_SIZE", "1"), ("RANK", "0"),
                                                                             ("LOCAL_RANK", "0")))
    if str(device).startswith("cuda"):
        # cuBLAS without a workspace: no split-K GEMMs, whose reduce kernels decode steps pay for (a user's value holds)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    _SETTINGS.update(device=dev, timeout_s=timeout_s)
    if world_size == 1:
        if tp_size != 1:
            raise ValueError(f"parallel.tp_size={tp_size} needs {tp_size} processes, but this run has 1: "
                             f"launch with torchrun --nproc_per_node={tp_size}")
        return single_process(dev)
    tp_groups, dp_groups = mesh_groups(world_size, tp_size)
    if not dist.is_initialized():
        _GROUP_CACHE.clear()
        _PEERS.clear()
        _PEER_GROUPS.clear()
        # Async error handling makes a stuck NCCL collective abort the process after the timeout. A device failed by
        # a peer kernel that gave up is this process's to report (peer_failure): NCCL's watchdog must not end the
        # process on seeing that CUDA error first.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        os.environ.setdefault("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0")
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
    world = Group("world", rank, world_size, tuple(range(world_size)), dist.group.WORLD)
    ps = ParallelState(world=world, tp=_my_group("tp", tp_groups, rank, timeout_s),
                       dp=_my_group("dp", dp_groups, rank, timeout_s), device=dev)
    use_allreduce(ps.tp, dev, allreduce)
    return ps


def _my_group(name: str, groups: list[tuple[int, ...]], rank: int, timeout_s: float) -> Group:
    """This rank's Group among `groups`; their process groups made on first use (every rank creates every group, in
    the same order) and reused after."""
    mine = None
    for ranks in groups:
        pg = _process_group(name, ranks, timeout_s) if len(ranks) > 1 else None
        if rank in ranks:
            mine = Group(name, ranks.index(rank), len(ranks), ranks, pg)
    return mine


def _process_group(kind: str, ranks: tuple[int, ...], timeout_s: float, backend: str | None = None):
    """The process group of `ranks` for groups of this kind (on `backend`, default the world's), made on first use
    (collective over the world: every rank asks for every group, in the same order) and reused after."""
    key = ("pg", kind, ranks, timeout_s, backend)
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s),
                                           backend=backend)
    return _GROUP_CACHE[key]


def all_gather_counts(n: int, group: Group, device: torch.device | str = "cpu",
                      flag: bool = False) -> tuple[list[int], bool]:
    """(every rank's integer n in rank order, whether any rank's flag is set): the once-per-step exchange of expert
    parallelism over DP ranks (token counts, and whether any token of the group has an adapter). Counted as
    "counts" so per-layer collective counts stay readable."""
    if group.size == 1:
        return [n], flag
    t = torch.tensor([n, int(flag)], dtype=torch.int64, device="cpu" if group.host_pg is not None else device)
    STATS.record("counts", group, t)
    if group.host_pg is not None:  # on the host: a step launched ahead is not waited for
        parts = [torch.empty_like(t) for _ in range(group.size)]
        dist.all_gather(parts, t, group=group.host_pg)
        got = torch.stack(parts)
    else:
        got = _gathered(t, group)
    return got[:, 0].tolist(), bool(got[:, 1].any())


_EXPERT_LAYOUT: dict[int, ParallelState] = {}  # id(tp group) -> its state, for model builders that get only tp


def init_expert_parallel(ps: ParallelState, ep_size: int = 1, ep_attention: str = "dp",
                         timeout_s: float = 300.0, allreduce: str = "auto") -> ParallelState:
    """Give ps its ep / moe_tp groups. Every rank must call this with the same arguments (group creation is
    collective). The ep group's dispatch / combine take peer memory as parallel.allreduce says (use_allreduce; over
    the attention tp group's ranks, its buffers). Returns ps, also registered for `expert_layout(ps.tp)`."""
    world = ps.world.size
    ep_groups = expert_mesh_groups(world, ps.tp.size, ep_size, ep_attention)
    if ep_size == 1:
        ps.ep, ps.moe_tp = Group("ep"), ps.tp
    else:
        mine = None
        host = ep_attention == "dp" and ps.device.type == "cuda"  # lockstep's counts exchanged on the host
        for ranks in ep_groups:  # every rank creates every group, in the same order
            pg = _process_group("ep", ranks, timeout_s)
            host_pg = _process_group("ep", ranks, timeout_s, "gloo") if host else None
            if ps.rank in ranks:
                mine = Group("ep", ranks.index(ps.rank), len(ranks), ranks, pg, host_pg=host_pg)
        ps.ep = mine
        ps.moe_tp = Group("moe_tp") if ep_attention == "tp" else ps.tp
        if ep_attention == "tp":
            mine.peer = ps.tp.peer if allreduce != "nccl" else None
        else:
            use_allreduce(mine, ps.device, allreduce)
    ps.ep_attention = ep_attention
    _EXPERT_LAYOUT[id(ps.tp)] = ps
    return ps


def expert_layout(tp: Group) -> ParallelState | None:
    """The state init_expert_parallel registered for this tp group, or None (no expert parallelism set up)."""
    return _EXPERT_LAYOUT.get(id(tp))


def shutdown() -> None:
    """Free the peer buffers (their mappings need the process group), then the process groups, and drop this
    module's references to them: a gloo group alive at interpreter exit aborts the process when its worker thread
    releases a finished collective's tensors (that needs the GIL, which an exiting interpreter no longer grants)."""
    _EXPERT_LAYOUT.clear()
    if dist.is_initialized():
        if _PEERS and torch.cuda.is_available():
            torch.cuda.synchronize()
        for g in _PEER_GROUPS:
            g.peer = None
        _PEER_GROUPS.clear()
        _PEERS.clear()
        _GROUP_CACHE.clear()
        dist.destroy_process_group()
