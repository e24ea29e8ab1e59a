"""parallel.allreduce: the dispatch (auto falls back to NCCL / gloo where the ranks lack peer memory, a bad value is
refused naming it) on CPU; with TP_LORA_TEST_DEVICE=cuda, the symmetric-memory all-reduce against NCCL's result at 2
and 4 GPUs (1 element to 2 MiB, odd sizes, bf16 and fp32, eager and inside CUDA graphs) and greedy decoding at tp2
through it against NCCL, CUDA graphs on."""
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


@pytest.mark.parametrize("world", [2, 4])
def test_symm_mem_matches_nccl(world):
    if not CUDA:
        pytest.skip("peer memory needs CUDA (TP_LORA_TEST_DEVICE=cuda)")
    if not enough_devices(world):
        pytest.skip(f"{world} ranks need {world} GPUs")
    got = run_ranks(_against_nccl, world, True, timeout_s=240)
    assert any(peer for peer, _ in got.values()) and any(not peer for peer, _ in got.values())
    bad = {k: d for k, (_, d) in got.items() if d != 0}
    assert not bad, f"differs from NCCL: {bad}"


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
    if not CUDA:
        pytest.skip("peer memory needs CUDA (TP_LORA_TEST_DEVICE=cuda)")
    if not enough_devices(2):
        pytest.skip("2 ranks need 2 GPUs")
    from tp_lora.assets import write_tiny_llama
    write_tiny_llama(tmp_path / "m", num_hidden_layers=2, hidden_size=256, intermediate_size=512, seed=5)
    ref_tokens, ref_lp, _ = run_ranks(_greedy, 2, str(tmp_path / "m"), "nccl")
    tokens, lp, graphed = run_ranks(_greedy, 2, str(tmp_path / "m"), "symm_mem")
    assert graphed > 0, "no step replayed a CUDA graph"
    assert tokens == ref_tokens
    assert max(abs(a - b) for x, y in zip(lp, ref_lp) for a, b in zip(x, y)) < 5e-2
