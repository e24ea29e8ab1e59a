"""The sampler on fresh random logits: greedy rows take the argmax (lowest id among equals) with its log-probability,
sampled rows draw from their temperature / top-p distribution with their own generators, and every row's
log-probability is that of the unscaled distribution."""
import torch

from tp_lora.engine.sampler import draw


def sample(logits, temperatures, top_p, generator) -> tuple[list[int], list[float]]:
    """draw's [2, N] rows on the host: (token ids, log-probabilities)."""
    toks, lps = draw(logits, temperatures, top_p, generator).tolist()
    return [int(t) for t in toks], lps


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax_and_its_logprob():
    logits = _logits(5, 300, 0)
    logits[2, [7, 200]] = 50.0  # a tie: the lower id
    toks, lps = sample(logits, [0.0] * 5, 1.0, None)
    assert toks == logits.argmax(-1).tolist() and toks[2] == 7
    want = torch.log_softmax(logits.double(), -1).max(-1).values.tolist()
    assert all(abs(a - b) < 1e-5 for a, b in zip(lps, want))


def test_sampled_rows_draw_their_own_distribution_and_report_unscaled_logprobs():
    logits = _logits(4, 50, 1)
    temps, top_p = [0.0, 0.7, 0.0, 1.3], [1.0, 0.5, 1.0, 1.0]
    gens = [None, torch.Generator().manual_seed(3), None, torch.Generator().manual_seed(4)]
    toks, lps = sample(logits, temps, top_p, gens)
    full = torch.log_softmax(logits, -1)
    for row, (t, lp) in enumerate(zip(toks, lps)):
        assert abs(lp - float(full[row, t])) < 1e-5, row
    assert toks[0] == int(logits[0].argmax()) and toks[2] == int(logits[2].argmax())
    # row 1 (top_p 0.5 at temperature 0.7): the pick is inside the smallest prefix reaching 0.5
    p = torch.softmax(logits[1] / 0.7, -1)
    order = p.argsort(descending=True)
    keep = order[:int((p[order].cumsum(0) < 0.5).sum()) + 1]
    assert toks[1] in keep.tolist()
    # the same seeds draw the same tokens
    again = sample(logits, temps, top_p, [None, torch.Generator().manual_seed(3), None,
                                          torch.Generator().manual_seed(4)])
    assert again[0] == toks


def test_sampled_rows_follow_their_distribution():
    """Many draws of one hot row (temperature 1): token frequencies near softmax(logits)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    toks, _ = sample(logits, [1.0] * 4000, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(torch.tensor(toks), minlength=4).double() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0].double(), -1), atol=0.03, rtol=0)
