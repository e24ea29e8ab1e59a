"""The peer-memory kernels in a group of one (the interpreter on CPU, natively on CUDA): the all-reduce fused with
the residual add + RMSNorm against the add_rms_norm kernel (one rank: the sum is x itself) and the torch reference,
the all-reduce (one-shot and two-shot) and the all-gather against x, with a buffer, signal pad and call counters made
here, exchanging by polling the data and by flags. Every program counts each call; calls alternate halves of the buffer; every element
read is marked empty again (-0.0's bits); with flags, the signal pad holds the call's number. Across ranks they run
against NCCL in tests/distributed/test_allreduce.py (CUDA)."""
import pytest
import torch

from tp_lora.distributed import peer
from tp_lora.distributed.peer import EMPTY, POLL_MAX_BYTES, PeerBuffer, PeerReport
from tp_lora.distributed.peer_kernels import all_gather, all_reduce
from tp_lora.ops.fp8 import empty_rows8
from tp_lora.ops.fused import add_rms_norm_ref
from tp_lora.ops.split_sums import SplitSums
from tp_lora.ops.triton.fused import add_rms_norm
from tp_lora.ops.triton.peer_norm import reduce_add_rms_norm


def group_of_one(dtype: torch.dtype, device: str, slot: int = 1 << 12, programs: int = 3):
    """(buffer, pads, PeerBuffer) of a group of one: its own buffer (2 halves of one slot, marked empty) and pad."""
    buf = torch.full((2 * slot,), EMPTY[dtype][1], dtype=EMPTY[dtype][0], device=device).view(dtype)
    pads = torch.zeros(programs, dtype=torch.int32, device=device)
    ptr = PeerBuffer(torch.tensor([buf.data_ptr()], device=device), torch.tensor([pads.data_ptr()], device=device),
                     torch.zeros(2 * programs, dtype=torch.int32, device=device), 0, 1, programs, slot,
                     PeerReport(torch.device(device)), int(60e9))
    return buf, pads, ptr


@pytest.fixture(params=["poll", "flags"])
def exchange(request, monkeypatch):
    """Each test under both exchanges: its small messages exchange by flags where the polling limit is 0."""
    if request.param == "flags":
        monkeypatch.setattr(peer, "POLL_MAX_BYTES", 0)
    return request.param


def check_exchange(staging: torch.Tensor, pads: torch.Tensor, buf: PeerBuffer, call: int, exchange: str):
    """After call number `call`: every program counted it (entered and finished), the pad holds it where the call exchanged by flags (is
    untouched where it polled), and the whole buffer is marked empty again."""
    assert buf.epochs.tolist() == [call] * (2 * buf.programs), "every program entered and finished the call"
    assert pads.tolist() == [call if exchange == "flags" else 0] * buf.programs
    ints = staging.view(EMPTY[staging.dtype][0])
    assert torch.equal(ints, torch.full_like(ints, EMPTY[staging.dtype][1])), "read elements are marked empty"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 8), (5, 100), (7, 256)])  # rows over the programs: a program takes several
@pytest.mark.parametrize("case", ["residual", "no_residual", "x_weight", "offset"])
def test_fused_reduce_norm_matches_add_rms_norm(device, dtype, rows, n, case, exchange):
    gen = torch.Generator().manual_seed(rows * n)
    x, res = (torch.randn(rows, n, generator=gen).to(dtype).to(device) for _ in range(2))
    w, xw = (torch.randn(n, generator=gen).to(dtype).to(device) for _ in range(2))
    res = None if case == "no_residual" else res
    xw = xw if case == "x_weight" else None
    offset = case == "offset"
    staging, pads, buf = group_of_one(dtype, device)
    kernel = add_rms_norm(x, res, w, 1e-6, offset, xw)
    ref = add_rms_norm_ref(x, res, w, 1e-6, offset, xw)
    for call in (1, 2, 3):  # halves 1, 0, 1
        got = reduce_add_rms_norm(x, res, w, 1e-6, offset, xw, buf)
        for g, k, r in zip(got, kernel, ref):
            assert torch.equal(g, k)
            tol = 1e-5 if dtype == torch.float32 else 8e-2
            torch.testing.assert_close(g.float(), r.float(), atol=tol, rtol=tol)
        check_exchange(staging, pads, buf, call, exchange)
    if dtype == torch.bfloat16:  # the normed rows quantized per token too (out8), as add_rms_norm writes them
        want8, got8 = empty_rows8(x), empty_rows8(x)
        add_rms_norm(x, res, w, 1e-6, offset, xw, want8)
        reduce_add_rms_norm(x, res, w, 1e-6, offset, xw, buf, False, got8)
        assert torch.equal(got8[1], want8[1]) and torch.equal(got8[0].float(), want8[0].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep", [7, 5, 0])  # the whole chunk, a rank's own rows fewer than its chunk, none
def test_fused_reduce_scatter_norm_keeps_the_residuals_rows(device, dtype, keep, exchange):
    """scatter: every row of the chunk is exchanged (the buffer is left empty), the first `keep` (the residual's)
    are summed, added and normed as add_rms_norm of them."""
    gen = torch.Generator().manual_seed(keep)
    x = torch.randn(7, 96, generator=gen).to(dtype).to(device)
    res = torch.randn(keep, 96, generator=gen).to(dtype).to(device)
    w = torch.randn(96, generator=gen).to(dtype).to(device)
    staging, pads, buf = group_of_one(dtype, device)
    want = add_rms_norm(x[:keep], res, w, 1e-6, False, None)
    for call in (1, 2):
        got = reduce_add_rms_norm(x, res, w, 1e-6, False, None, buf, scatter=True)
        assert all(g.shape == (keep, 96) and torch.equal(g, k) for g, k in zip(got, want))
        check_exchange(staging, pads, buf, call, exchange)
    with pytest.raises(ValueError, match="a residual of 8 rows against chunks of 7"):
        reduce_add_rms_norm(x, torch.zeros(8, 96, dtype=dtype, device=device), w, 1e-6, False, None, buf, True)


def test_fused_reduce_norm_refuses_a_message_over_the_buffer(device):
    _, _, buf = group_of_one(torch.float32, device, slot=256)
    x = torch.ones(3, 128, device=device)
    with pytest.raises(ValueError, match="3 x 128 elements exceed the peer buffer's slot of 256"):
        reduce_add_rms_norm(x, None, torch.ones(128, device=device), 1e-6, False, None, buf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("kind", ["one_share_delta", "shares_scaled", "shares_delta"])
def test_fused_reduce_norm_sums_a_gemms_split_sums_before_the_exchange(device, dtype, rows, kind, exchange):
    """x as a GEMM's SplitSums (its float32 K shares with column / row scales, or its output as one share in its
    dtype, with or without a LoRA delta): this rank's rows are summed and rounded as the GEMM (and the expand adding
    into its output) would leave them, before they are exchanged, summed and normed: one rank's add_rms_norm kernel
    over the same SplitSums, bit for bit."""
    gen = torch.Generator().manual_seed(rows + 17)
    x, res = (torch.randn(rows, 160, generator=gen).to(dtype).to(device) for _ in range(2))
    w = torch.randn(160, generator=gen).to(dtype).to(device)
    delta = (torch.randn(rows, 160, generator=gen) * 0.37).to(device)
    delta[1:2] = 0.0  # a token without an adapter (where there are two)
    if kind == "one_share_delta":
        sums = SplitSums(x[None], None, None, dtype, delta)
    else:
        parts = torch.randn(3, rows, 160, generator=gen).to(device)
        col, row = (torch.rand(m, generator=gen).to(device) + 0.5 for m in (160, rows))
        sums = SplitSums(parts, col, row, dtype, delta if kind == "shares_delta" else None)
    staging, pads, buf = group_of_one(dtype, device)
    # one rank's kernel over the same SplitSums: the same rounding (the interpreter's too). Unrounded float32 rows
    # may see the row scale's product fused with the next add (FMA) in one kernel and not the other: within an ulp.
    want = add_rms_norm(sums, res, w, 1e-6, False, None)
    ref = add_rms_norm_ref(sums.total(), res, w, 1e-6)
    for call in (1, 2):
        got = reduce_add_rms_norm(sums, res, w, 1e-6, False, None, buf)
        for g, k in zip(got, want):
            assert g.dtype == dtype
            if dtype == torch.float32 and kind != "one_share_delta":
                torch.testing.assert_close(g, k, atol=1e-6, rtol=1e-6)
            else:
                assert torch.equal(g, k)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g.float(), r.float(), atol=8e-2, rtol=8e-2)
        check_exchange(staging, pads, buf, call, exchange)
    plain = add_rms_norm(sums.parts[0].to(dtype), res, w, 1e-6, False, None)[1]
    assert not torch.equal(want[1], plain), "the sum (and delta) change the rows"
    with pytest.raises(ValueError, match="SplitSums need contiguous parts and no scatter"):
        reduce_add_rms_norm(sums, res, w, 1e-6, False, None, buf, scatter=True)


@pytest.mark.parametrize("two_shot", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 2048, 5000])  # a part of a block, one block, blocks over programs
def test_all_reduce_of_one_is_x(device, dtype, n, exchange, two_shot):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype).to(device)
    x[0] = -0.0  # sent as +0.0: the sum's value, with the empty mark's bits never staged
    staging, pads, buf = group_of_one(dtype, device, slot=1 << 14)
    for call in (1, 2, 3):
        got = x.clone()
        assert all_reduce(got, buf, two_shot) is got
        assert torch.equal(got, x) and not torch.signbit(got[0])
        check_exchange(staging, pads, buf, call, "poll" if two_shot else exchange)


def test_calls_over_the_polling_limit_exchange_by_flags():
    buf = group_of_one(torch.float32, "cpu")[2]
    assert buf.polls(POLL_MAX_BYTES) and not buf.polls(POLL_MAX_BYTES + 1)


def test_all_reduce_refuses_what_it_cannot_take(device):
    _, _, buf = group_of_one(torch.float32, device, slot=256)
    with pytest.raises(ValueError, match="257 elements exceed a slot of 256"):
        all_reduce(torch.ones(257, device=device), buf)
    with pytest.raises(ValueError, match="129 elements exceed a slot of 256 in two chunks of 129"):
        all_reduce(torch.ones(129, device=device), buf, two_shot=True)
    with pytest.raises(ValueError, match=r"contiguous tensor expected, got strides \(1, 4\)"):
        all_reduce(torch.ones(4, 4, device=device).t(), buf)


@pytest.mark.parametrize("shape,dim", [((7,), 0), ((3, 5), -1), ((3, 5), 0), ((2, 3, 2100), -1)])
def test_all_gather_of_one_is_x(device, shape, dim, exchange):
    x = torch.randn(shape).to(device)
    staging, pads, buf = group_of_one(torch.float32, device, slot=1 << 14)
    for call in (1, 2):
        assert torch.equal(all_gather(x, dim, buf), x)
        check_exchange(staging, pads, buf, call, exchange)
    with pytest.raises(ValueError, match="dim 1 of a 3-dim tensor"):
        all_gather(torch.ones(2, 3, 4, device=device), 1, buf)
    with pytest.raises(ValueError, match=r"3 x 6000 elements exceed a slot of 16384"):
        all_gather(torch.ones(3, 6000, device=device), -1, buf)


class _FailedDevice:
    """A recorded event whose query fails, as every CUDA call does once a kernel has trapped."""

    def query(self):
        raise RuntimeError("CUDA error: unspecified launch failure")


def test_a_device_failed_by_a_peer_kernel_raises_collective_timeout_naming_the_peer(monkeypatch):
    from tp_lora import distributed as comm
    report = PeerReport(torch.device("cpu"))
    failure = lambda self: report.failure(0, 2.0, torch.float32)  # noqa: E731
    monkeypatch.setitem(comm._PEERS, "group", type("Peer", (), {"failure": failure, "staging": {}})())
    with pytest.raises(RuntimeError, match="unspecified launch failure"):  # no report written: the device's error
        comm.wait_event(_FailedDevice(), torch.device("cuda", 0))
    report.words.copy_(torch.tensor([2, 1, 6, 5, 7500], dtype=torch.int32))  # as note_wait writes it: still waiting
    with pytest.raises(comm.CollectiveTimeout, match=r"rank 0 of the group was waiting for rank 1's data in "
                                                     r"peer-memory collective call 6 \(program 5\) over the float32 "
                                                     r"buffer when its device failed \(for 7.5s at least(.|\n)*last "
                                                     r"collectives of this rank"):
        comm.wait_event(_FailedDevice(), torch.device("cuda", 0))
    report.words.copy_(torch.tensor([1, 1, 7, 3, 0], dtype=torch.int32))  # as give_up writes it
    with pytest.raises(comm.CollectiveTimeout, match=r"rank 0 of the group waited more than parallel.timeout_s=2s "
                                                     r"for rank 1's data in peer-memory collective call 7 "
                                                     r"\(program 3\) over the float32 buffer"):
        comm.wait_event(_FailedDevice(), torch.device("cuda", 0))


class _BusyDevice:
    """A recorded event that never passes: a device still running (a kernel that never ends)."""

    def query(self):
        return False


def test_a_device_that_never_finishes_reports_the_calls_its_programs_entered(device, monkeypatch):
    """The host's deadline passes on a device that has not failed: the report lists each staging buffer's last
    launches and the calls the device's programs entered there (read beside the busy device), so a stalled rank
    shows whether it stopped before, or inside, the call its peers waited in."""
    from tp_lora import distributed as comm
    staging, _, buf = group_of_one(torch.float32, device)
    x = torch.ones(3, 5, device=device)
    all_reduce(x, buf)
    all_gather(x, -1, buf)
    reduce_add_rms_norm(x, None, torch.ones(5, device=device), 1e-6, False, None, buf)
    assert buf.progress() == "entered 3, finished 3"
    buf.epochs[1] = 2  # program 1 has not entered call 3 yet
    buf.epochs[buf.programs + 2] = 2  # program 2 has not finished it
    monkeypatch.setitem(comm._PEERS, "tp", type("Peer", (), {"staging": {torch.float32: (staging, buf)}})())
    monkeypatch.setitem(comm._SETTINGS, "timeout_s", 0.05)
    with pytest.raises(comm.CollectiveTimeout, match=r"did not complete within parallel.timeout_s=0.05s(.|\n)*tp "
                                                     r"float32: 3 launched \(last: #1 all_reduce \[3, 5\], #2 "
                                                     r"all_gather \[3, 5\], #3 all_reduce \+ norm \[3, 5\]\), the "
                                                     r"device's programs entered 2-3, finished 2-3"):
        comm.wait_event(_BusyDevice(), torch.device("cuda", 0))
