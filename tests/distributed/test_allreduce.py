"""parallel.allreduce: the dispatch (auto falls back to NCCL / gloo where the ranks lack peer memory, a bad value is
refused naming it) on CPU; with TP_LORA_TEST_DEVICE=cuda, the symmetric-memory all-reduce against NCCL's result at 2
and 4 GPUs (1 element to 2 MiB, odd sizes, bf16 and fp32, eager and inside CUDA graphs) and greedy decoding at tp2
through it against NCCL, CUDA graphs on; the all-reduce fused with the residual add + RMSNorm after it and the peer
all-gather against NCCL + the add_rms_norm kernel / NCCL's all-gather at 2 GPUs (odd sizes, bf16 and fp32, eager and
in graphs; the reduce-scatter form too, one rank keeping fewer rows than its chunk), and on CPU the unfused dispatch
of reduce_add_rms_norm; a second set of groups over the same ranks (its own peer buffers) reduces as NCCL, used
between the first's calls; a peer kernel waiting for a call its peer skipped gives up at its group's timeout and the
host's error names the peer and the call (polling and flags); the fused kernel over rows narrower than its threads
never stalls with the ranks skewed; a CUDA run's cuBLAS gets no workspace unless the user gave one."""
import os
import subprocess
import sys
import time

import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.config import ConfigError, RunConfig, validate
from tp_lora.testing import device_under_test, enough_devices, run_ranks

CUDA = device_under_test() == "cuda"


def test_bad_value_is_refused_naming_it():
    cfg = RunConfig()
    cfg.parallel.allreduce = "nvls"
    with pytest.raises(ConfigError, match="parallel.allreduce='nvls': expected auto, nccl or symm_mem"):
        validate(cfg)
    cfg.parallel.allreduce, cfg.device = "symm_mem", "cpu"
    with pytest.raises(ConfigError, match="parallel.allreduce=symm_mem .* device=cpu"):
        validate(cfg)
    with pytest.raises(ValueError, match="parallel.allreduce='fast'"):  # before any process group exists
        comm.init_parallel(2, "cpu", allreduce="fast")


CUBLAS_CHECK = """
import os, torch
torch.cuda.set_device = lambda i: None  # no GPU needed: the device is only named
from tp_lora import distributed as comm
comm.init_parallel(1, os.environ["RUN_DEVICE"])
print(os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
"""


@pytest.mark.parametrize("device,user,want", [("cuda", None, ":0:0"), ("cuda", ":4096:8", ":4096:8"),
                                              ("cpu", None, "None")])
def test_cuda_runs_ask_cublas_for_no_workspace(device, user, want):
    """A CUDA run's cuBLAS gets no workspace (so no split-K GEMMs) unless the user set CUBLAS_WORKSPACE_CONFIG; a CPU
    run leaves it alone. In a fresh process: torch reads the variable at its first cuBLAS call."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUBLAS_WORKSPACE_CONFIG", "WORLD_SIZE", "RANK")}
    env.update(RUN_DEVICE=device, **({"CUBLAS_WORKSPACE_CONFIG": user} if user else {}))
    out = subprocess.run([sys.executable, "-c", CUBLAS_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want


def _choices(ps: comm.ParallelState):
    auto = comm.use_allreduce(ps.tp, ps.device, "auto")
    summed = comm.all_reduce(torch.full((5,), float(ps.rank + 1), device=ps.device), ps.tp)
    try:
        comm.use_allreduce(ps.tp, ps.device, "symm_mem")
        refused = None
    except ValueError as e:
        refused = str(e)
    return auto, ps.tp.peer is None, summed.tolist(), refused


@pytest.mark.skipif(CUDA, reason="the CPU dispatch (gloo ranks)")
def test_auto_falls_back_to_gloo_without_peer_memory():
    auto, no_peer, summed, refused = run_ranks(_choices, 2)
    assert auto == "nccl" and no_peer
    assert summed == [3.0] * 5
    assert refused is not None and "parallel.allreduce=symm_mem" in refused and "the ranks run on cpu" in refused


# Elements: 1 to 2 MiB of bf16, odd counts, and either side of the largest message the peer path takes.
SIZES = [1, 2, 3, 7, 8, 9, 1000, 1023, 4097, 65536 + 5, 131072, 262144 + 3, 524288 - 1, 1 << 20,
         comm.PEER_MAX_BYTES // 2, comm.PEER_MAX_BYTES // 2 + 8]


def _against_nccl(ps: comm.ParallelState, graphs: bool):
    """Per (dtype, size): whether the peer path ran (not NCCL above its limit) and the largest difference from
    NCCL's sum of the same tensors, eager and (graphs) replayed from one CUDA graph on fresh data."""
    assert comm.use_allreduce(ps.tp, ps.device, "symm_mem") == "symm_mem"
    nccl = comm.Group("tp", ps.tp.rank, ps.tp.size, ps.tp.ranks, ps.tp.pg)
    gen = torch.Generator(device=ps.device).manual_seed(100 + ps.rank)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        for n in SIZES:
            if n * dtype.itemsize > comm.PEER_MAX_BYTES + 16:
                continue
            # Small integers: every order of summation gives the same sum in bf16 too.
            x = torch.randint(-8, 9, (n,), generator=gen, device=ps.device).to(dtype)
            want = comm.all_reduce(x.clone(), nccl)
            got = comm.all_reduce(x.clone(), ps.tp)
            diffs = [(got.float() - want.float()).abs().max().item()]
            if graphs:
                static = torch.full_like(x, float("nan"))
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    comm.all_reduce(static, ps.tp)
                for _ in range(2):
                    y = torch.randint(-8, 9, (n,), generator=gen, device=ps.device).to(dtype)
                    static.copy_(y)
                    g.replay()
                    diffs.append((static.float() - comm.all_reduce(y, nccl).float()).abs().max().item())
                del g
            out[(str(dtype), n)] = (ps.tp.peer.takes(x), max(diffs))
    torch.cuda.synchronize()
    return out


def _needs_peer_gpus(world: int) -> None:
    """Skip unless the tests run on CUDA with `world` GPUs: peer memory's tests."""
    if not CUDA:
        pytest.skip("peer memory needs CUDA (TP_LORA_TEST_DEVICE=cuda)")
    if not enough_devices(world):
        pytest.skip(f"{world} ranks need {world} GPUs")


def _peer_runs(fn, world: int, *args, timeout_s: float) -> dict:
    """fn's {case: (peer path taken, largest difference from NCCL)} on `world` GPU ranks, every difference 0."""
    _needs_peer_gpus(world)
    got = run_ranks(fn, world, *args, timeout_s=timeout_s)
    bad = {k: d for k, (_, d) in got.items() if d != 0}
    assert not bad, f"differs from NCCL: {bad}"
    return got


@pytest.mark.parametrize("world", [2, 4])
def test_symm_mem_matches_nccl(world):
    got = _peer_runs(_against_nccl, world, True, timeout_s=240)
    assert any(peer for peer, _ in got.values()) and any(not peer for peer, _ in got.values())


def _second_group(ps: comm.ParallelState):
    """A second init_parallel over the same ranks with another timeout (its own process groups and peer buffers, as
    the rank pool's task groups and a test's own init_parallel make): the first group's peer path, then the
    second's in CUDA graphs, then the first's again, each against NCCL."""
    second = comm.init_parallel(ps.tp.size, str(ps.device), timeout_s=97.0)
    assert second.tp.peer is not None and second.tp.peer is not ps.tp.peer
    runs = [_against_nccl(ps, False), _against_nccl(second, True), _against_nccl(ps, True)]
    return {(i, *k): v for i, run in enumerate(runs) for k, v in run.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_a_second_group_over_the_same_ranks_reduces_as_nccl(world):
    _peer_runs(_second_group, world, timeout_s=120)


def _skipped_call(ps: comm.ParallelState, flags: bool):
    """Rank 1 skips a peer collective rank 0 makes: rank 0's kernel gives up after its group's 2 s and fails the
    device; the host, waiting up to 60 s, raises CollectiveTimeout with the kernel's report (not its own deadline)."""
    fast = comm.init_parallel(ps.tp.size, "cuda", timeout_s=2.0)  # its peer kernels' deadline
    comm.init_parallel(ps.tp.size, "cuda", timeout_s=60.0)  # the host's wait
    comm.all_reduce(torch.ones(8, dtype=torch.bfloat16, device=ps.device), fast.tp)  # the bf16 buffer's call 1
    comm.wait_device(ps.device)
    if ps.rank == 0:
        if flags:  # 2 MiB gathered: more than POLL_MAX_BYTES, so the exchange waits on flags
            comm.all_gather(torch.ones(512, 1024, dtype=torch.bfloat16, device=ps.device), fast.tp, dim=0)
        else:
            comm.all_reduce(torch.ones(64, dtype=torch.bfloat16, device=ps.device), fast.tp)
        comm.wait_device(ps.device)
    else:
        time.sleep(30)


@pytest.mark.parametrize("flags", [False, True])
def test_a_peer_kernel_gives_up_on_a_skipped_call_naming_it(flags):
    _needs_peer_gpus(2)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"CollectiveTimeout: rank 0 of the group waited more than "
                                           r"parallel.timeout_s=2s for rank 1's data in peer-memory collective call 2"):
        run_ranks(_skipped_call, 2, flags, timeout_s=90)
    assert time.monotonic() - t0 < 50


def _narrow_rows(ps: comm.ParallelState, calls: int):
    """The fused all-reduce + norm of rows narrower than its program's threads (hidden 32 and 64: warps hold copies of
    the same elements and poll on their own copies; 29-32 rows, one per program), `calls` times with the ranks skewed
    by a random device sleep before each, so data lands while the other rank polls; every 50th call against NCCL +
    the add_rms_norm kernel.
    A warp that emptied elements another warp still polled for stalled the call: its kernel gives up after 5 s."""
    from tp_lora.ops.fused import reduce_add_rms_norm
    from tp_lora.ops.triton.fused import add_rms_norm
    fast = comm.init_parallel(ps.tp.size, "cuda", timeout_s=5.0)  # the peer kernels' deadline
    comm.init_parallel(ps.tp.size, "cuda", timeout_s=60.0)  # the host's wait
    assert comm.use_allreduce(fast.tp, ps.device, "symm_mem") == "symm_mem"
    nccl = comm.Group("tp", ps.tp.rank, ps.tp.size, ps.tp.ranks, ps.tp.pg)
    gen = torch.Generator().manual_seed(300 + ps.rank)
    same = torch.Generator(device=ps.device).manual_seed(9)
    worst = 0.0
    for i in range(calls):
        t, n = (32, 32) if i % 2 else (29, 64)  # a row per program: every program polls in every call
        x = torch.randn(t, n, device=ps.device).to(torch.bfloat16)
        res, w = (torch.randn(t, n, generator=same, device=ps.device).to(torch.bfloat16),
                  torch.randn(n, generator=same, device=ps.device).to(torch.bfloat16))
        torch.cuda._sleep(int(torch.randint(0, 4000, (1,), generator=gen)))
        got = reduce_add_rms_norm(x, res, w, 1e-5, False, None, fast.tp)
        if i % 50 == 0:
            want = add_rms_norm(comm.all_reduce(x.clone(), nccl), res, w, 1e-5, False, None)
            worst = max(worst, max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want)))
    comm.wait_device(ps.device)
    return worst


def test_fused_reduce_norm_of_rows_narrower_than_its_threads_never_stalls():
    _needs_peer_gpus(2)
    assert run_ranks(_narrow_rows, 2, 4000, timeout_s=90) == 0.0


def _greedy(ps: comm.ParallelState, model: str, choice: str):
    from tp_lora.engine.engine import Engine
    from tp_lora.engine.requests import Request
    assert comm.use_allreduce(ps.tp, ps.device, choice) == choice
    cfg = RunConfig()
    cfg.parallel.tp_size = ps.tp.size
    cfg.device, cfg.dtype, cfg.generation.ignore_eos = "cuda", "float32", True
    engine = Engine(cfg, ps, model, None)
    gen = torch.Generator().manual_seed(3)
    reqs = [Request(i, id=i, max_new_tokens=12, prompt_token_ids=torch.randint(0, 256, (4 + 3 * i,),
                                                                               generator=gen).tolist())
            for i in range(6)]
    res = engine.generate(reqs)
    graphed = engine.stats.graph_steps
    engine.close()
    return [r.output_token_ids for r in res], [r.logprobs for r in res], graphed


def test_engine_tp2_symm_mem_matches_nccl(tmp_path):
    _needs_peer_gpus(2)
    from tp_lora.assets import write_tiny_llama
    write_tiny_llama(tmp_path / "m", num_hidden_layers=2, hidden_size=256, intermediate_size=512, seed=5)
    ref_tokens, ref_lp, _ = run_ranks(_greedy, 2, str(tmp_path / "m"), "nccl")
    tokens, lp, graphed = run_ranks(_greedy, 2, str(tmp_path / "m"), "symm_mem")
    assert graphed > 0, "no step replayed a CUDA graph"
    assert tokens == ref_tokens
    assert max(abs(a - b) for x, y in zip(lp, ref_lp) for a, b in zip(x, y)) < 5e-2


def _reduce_norm_dispatch(ps: comm.ParallelState):
    """reduce_add_rms_norm on gloo ranks (the unfused path: all_reduce, then add_rms_norm) against the torch
    reference of the summed x every rank computes from all ranks' seeds; all_reduce calls counted."""
    from tp_lora.ops.fused import add_rms_norm_ref, reduce_add_rms_norm
    xs = [torch.randn(3, 16, generator=torch.Generator().manual_seed(r)) for r in range(ps.tp.size)]
    res, w = torch.randn(3, 16, generator=torch.Generator().manual_seed(99)), torch.rand(16) + 0.5
    comm.STATS.reset()
    got = reduce_add_rms_norm(xs[ps.tp.rank].clone(), res, w, 1e-6, False, None, ps.tp)
    want = add_rms_norm_ref(sum(xs), res, w, 1e-6)
    diffs = [(g - h).abs().max().item() for g, h in zip(got, want)]
    # scatter: rows 0-1 are rank 0's chunk, 2 rank 1's (of which it keeps 1 row); sizes as the residual's
    keep = (1, 2)[ps.tp.rank]
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + r)) for r in range(ps.tp.size)]
    got = reduce_add_rms_norm(xs[ps.tp.rank].clone(), res[:keep], w, 1e-6, False, None, ps.tp, scatter=True)
    own = sum(xs)[2 * ps.tp.rank:2 * ps.tp.rank + keep]
    diffs += [(g - h).abs().max().item() for g, h in zip(got, add_rms_norm_ref(own, res[:keep], w, 1e-6))]
    return diffs, [g.shape[0] for g in got], comm.STATS.total("all_reduce"), comm.STATS.total("reduce_scatter")


@pytest.mark.skipif(CUDA, reason="the CPU dispatch (gloo ranks)")
def test_reduce_norm_on_gloo_reduces_then_norms():
    diffs, rows, reduces, scatters = run_ranks(_reduce_norm_dispatch, 2)
    assert reduces == 1 and scatters == 1 and rows == [1, 1] and max(diffs) < 1e-5


def _eager_and_graphed(fused, unfused, draw) -> tuple[torch.Tensor, float]:
    """(the first input drawn, the largest difference of fused's outputs from unfused's on it, eager, and replayed
    from a CUDA graph of fused on two fresh draws)."""
    x = draw()
    diffs = [max((a.float() - b.float()).abs().max().item() for a, b in zip(fused(x), unfused(x)))]
    static = x.clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = fused(static)
    for _ in range(2):
        y = draw()
        static.copy_(y)
        g.replay()
        diffs.append(max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, unfused(y))))
    del g
    return x, max(diffs)


def _fused_against_nccl(ps: comm.ParallelState):
    """Per (dtype, rows x hidden, case): whether the fused peer kernel ran, and the largest difference of its
    (normed, stream) from NCCL's all-reduce + the add_rms_norm kernel, eager and replayed from a CUDA graph on fresh
    data; the same for the peer all-gather against NCCL's (dim 0 and the last)."""
    from tp_lora.ops.fused import reduce_add_rms_norm
    from tp_lora.ops.triton.fused import add_rms_norm
    assert comm.use_allreduce(ps.tp, ps.device, "symm_mem") == "symm_mem"
    nccl = comm.Group("tp", ps.tp.rank, ps.tp.size, ps.tp.ranks, ps.tp.pg)
    gen = torch.Generator(device=ps.device).manual_seed(200 + ps.rank)
    same = torch.Generator(device=ps.device).manual_seed(7)  # the residual and weights: one stream on every rank
    out = {}

    def rand(*shape, dtype, g=gen):
        return torch.randn(*shape, generator=g, device=ps.device).to(dtype)

    for dtype in (torch.bfloat16, torch.float32):
        for t, n in ((1, 8), (3, 100), (7, 4096), (33, 1000), (32, 4096)):
            for case in ("residual", "no_residual", "x_weight"):
                res = rand(t, n, dtype=dtype, g=same) if case != "no_residual" else None
                w, xw = rand(n, dtype=dtype, g=same), rand(n, dtype=dtype, g=same) if case == "x_weight" else None

                def fused(x):
                    return reduce_add_rms_norm(x, res, w, 1e-5, False, xw, ps.tp)

                def unfused(x):
                    return add_rms_norm(comm.all_reduce(x.clone(), nccl), res, w, 1e-5, False, xw)

                x, diff = _eager_and_graphed(fused, unfused, lambda: rand(t, n, dtype=dtype))
                out[("fused", str(dtype), t, n, case)] = (ps.tp.peer.takes_fused(x), diff)
        for c, n, fewer in ((4, 100, 0), (32, 2048, 0), (32, 2048, 1), (17, 4096, 1)):
            keep = c - 3 if ps.tp.rank == fewer else c  # a rank's own rows fewer than its chunk: rank `fewer`'s
            res, w = rand(keep, n, dtype=dtype), rand(n, dtype=dtype, g=same)

            def fused(x):
                return reduce_add_rms_norm(x, res, w, 1e-5, False, None, ps.tp, scatter=True)

            def unfused(x):
                return add_rms_norm(comm.reduce_scatter(x.clone(), nccl)[:keep], res, w, 1e-5, False, None)

            x, diff = _eager_and_graphed(fused, unfused, lambda: rand(2 * c, n, dtype=dtype))
            out[("scatter", str(dtype), c, n, fewer)] = (ps.tp.peer.takes_fused(x), diff)
        for shape, dim in (((5,), 0), ((3, 7), -1), ((32, 8), -1), ((9, 33), 0), ((32, 16000), -1)):
            x = rand(*shape, dtype=dtype)
            diffs = [(comm.all_gather(x, ps.tp, dim) != comm.all_gather(x, nccl, dim)).sum().item()]
            static = x.clone()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                got = comm.all_gather(static, ps.tp, dim)
            y = rand(*shape, dtype=dtype)
            static.copy_(y)
            g.replay()
            diffs.append((got != comm.all_gather(y, nccl, dim)).sum().item())
            del g
            out[("gather", str(dtype), shape, dim)] = (ps.tp.peer.takes_gather(x, ps.tp.size), max(diffs))
    torch.cuda.synchronize()
    return out


def test_fused_reduce_norm_and_gather_match_nccl():
    _needs_peer_gpus(2)
    got = run_ranks(_fused_against_nccl, 2, timeout_s=240)
    assert all(peer for k, (peer, _) in got.items() if k[0] == "gather")
    assert all(peer for k, (peer, _) in got.items() if k[0] in ("fused", "scatter") and k[2] * k[3] * 4 <= 256 << 10)
    # Two ranks: the fused kernel's float32 sum rounded once is NCCL's sum; the norm is the same kernel code.
    bad = {k: d for k, (_, d) in got.items() if d != 0}
    assert not bad, f"differs from NCCL: {bad}"
