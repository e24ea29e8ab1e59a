"""The sampler on fresh random logits: greedy rows take the argmax (lowest id among equals) with its log-probability,
temperatures below GREEDY_BELOW too, sampled rows draw from their temperature / top-p distribution (seeded rows the
same whatever shares their step), and every row's log-probability is that of the model's distribution (unscaled,
before logit rules); stop_token_ids are looked up as a set. Logit rules
(penalties, logit_bias, min_tokens) against a plain per-token reference of the OpenAI / vLLM definitions."""
import pytest
import torch

from tp_lora.config import GenerationConfig
from tp_lora.engine.logit_rules import LogitRules
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.sampler import GREEDY_BELOW, Sampler, draw


def sample(logits, temperatures, top_p, generator, seeds=None, steps=None) -> tuple[list[int], list[float]]:
    """draw's [2, N] rows on the host: (token ids, log-probabilities)."""
    toks, lps = draw(logits, temperatures, top_p, generator, seeds, steps).tolist()
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
    toks, lps = sample(logits, temps, top_p, torch.Generator().manual_seed(3), [None, None, None, 4], [0, 0, 0, 5])
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
    again = sample(logits, temps, top_p, torch.Generator().manual_seed(3), [None, None, None, 4], [0, 0, 0, 5])
    assert again[0] == toks


def test_sampled_rows_follow_their_distribution():
    """Many draws of one hot row (temperature 1): token frequencies near softmax(logits)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    toks, _ = sample(logits, [1.0] * 4000, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(torch.tensor(toks), minlength=4).double() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0].double(), -1), atol=0.03, rtol=0)


def test_seeded_rows_draw_the_same_whatever_shares_their_step():
    logits = _logits(6, 64, 2)
    alone = [sample(logits[i:i + 1], [1.0], 1.0, None, [100 + i], [3])[0][0] for i in range(6)]
    together, _ = sample(logits, [1.0] * 6, 1.0, torch.Generator().manual_seed(0), [100 + i for i in range(6)], [3] * 6)
    assert together == alone
    # the seeded noise follows the distribution over many (seed, step) pairs
    row = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    toks, _ = sample(row, [1.0] * 4000, 1.0, None, list(range(4000)), [7] * 4000)
    freq = torch.bincount(torch.tensor(toks), minlength=4).double() / 4000
    torch.testing.assert_close(freq, torch.softmax(row[0].double(), -1), atol=0.03, rtol=0)


def _reference_rules(logits, prompt, generated, req, eos):
    """One row, token by token: logit_bias, then repetition over prompt + generated (vLLM), then frequency and
    presence over the generated tokens (OpenAI), then min_tokens holding back EOS and stop_token_ids."""
    x = logits.double().clone()
    for tok, b in req.logit_bias.items():
        x[tok] += b
    for tok in range(x.shape[0]):
        c = generated.count(tok)
        if tok in prompt or c:
            x[tok] = x[tok] / req.repetition_penalty if x[tok] > 0 else x[tok] * req.repetition_penalty
        x[tok] -= c * req.frequency_penalty + (c > 0) * req.presence_penalty
    if len(generated) < req.min_tokens:
        for tok in list(eos) + req.stop_token_ids:
            x[tok] = float("-inf")
    return x


def test_logit_rules_match_the_definitions_over_steps():
    vocab, eos = 40, {2}
    g = torch.Generator().manual_seed(5)
    reqs = [Request(0, 0, prompt_token_ids=[3, 4, 4, 9], presence_penalty=0.5, frequency_penalty=0.3,
                    repetition_penalty=1.3, min_tokens=3, stop_token_ids=[7]),
            Request(1, 1, prompt_token_ids=[5]),  # no rules: its row untouched
            Request(2, 2, prompt_token_ids=[1, 2], logit_bias={11: 5.0, 12: -3.0}, frequency_penalty=-0.7),
            Request(3, 3, prompt_token_ids=[8], repetition_penalty=0.8)]
    rules = LogitRules(eos)
    generated = [[] for _ in reqs]
    for step in range(6):
        logits = torch.randn(len(reqs), vocab, generator=g) * 3
        got = rules.apply(logits, reqs, [len(x) for x in generated])
        for i, req in enumerate(reqs):
            want = _reference_rules(logits[i], req.prompt_token_ids, generated[i], req, eos)
            torch.testing.assert_close(got[i].double(), want, atol=1e-5, rtol=1e-5, msg=f"step {step} row {i}")
        toks = torch.randint(0, vocab, (len(reqs),), generator=g)
        toks[0] = 4  # a prompt token, generated again
        rules.update(toks.double())
        for i, t in enumerate(toks.tolist()):
            generated[i].append(t)
    rules.forget(0)
    assert 0 not in rules.row_of and rules.free


def test_sampler_bias_forces_a_token_and_min_tokens_holds_back_eos():
    vocab, eos = 30, 2
    s = Sampler(GenerationConfig(), {eos}, None)
    reqs = [Request(0, 0, prompt_token_ids=[1], logit_bias={17: 100.0}, temperature=1.0),
            Request(1, 1, prompt_token_ids=[1], min_tokens=3, stop_token_ids=[5], max_new_tokens=8),
            Request(2, 2, prompt_token_ids=[1], stop_token_ids=[5], max_new_tokens=8)]
    logits = torch.zeros(3, vocab)
    logits[:, eos] = 10.0
    logits[:, 5] = 9.0
    logits[:, 20] = 8.0  # the best token neither EOS nor a stop token id
    firsts = []
    for step in range(4):
        toks, lps = s.sample(logits, reqs).tolist()
        firsts.append([int(t) for t in toks])
        assert lps[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[17]), abs=1e-6)  # the model's
    assert all(f[0] == 17 for f in firsts)
    assert [f[1] for f in firsts] == [20] * 3 + [eos]
    assert all(f[2] == eos for f in firsts)
    res = Result(reqs[2])
    assert s.finished(res, 5, 1) and res.finish_reason == "stop"  # a stop token id ends it
    assert not s.finished(Result(reqs[2]), 6, 1)


def test_temperatures_below_the_bound_are_greedy_and_just_above_it_sample():
    """1e-38 overflows float32 logits and 1e-300 is 0 there: they, and any temperature below GREEDY_BELOW, pick what
    temperature 0 picks (a two-way tie: the lower id) with its log-probability; at GREEDY_BELOW and just above a row
    still samples (the tie splits) with finite log-probabilities."""
    rows = 400
    logits = torch.full((rows, 9), -3.0)
    logits[:, [2, 6]] = 4.0
    want = sample(logits, [0.0] * rows, 1.0, None)
    assert set(want[0]) == {2}
    for t in (1e-300, 1e-38, 1e-20, GREEDY_BELOW * (1 - 1e-6)):
        for top_p in (1.0, 0.9):
            assert sample(logits, [t] * rows, top_p, torch.Generator().manual_seed(0)) == want, (t, top_p)
        assert sample(logits, [t] * rows, 1.0, None, list(range(rows)), [0] * rows) == want, t  # seeded rows
    for t in (GREEDY_BELOW, GREEDY_BELOW * (1 + 1e-6), 1e-3):
        toks, lps = sample(logits, [t] * rows, 1.0, torch.Generator().manual_seed(0))
        assert set(toks) == {2, 6} and 120 < toks.count(6) < 280, t
        assert all(abs(lp - want[1][0]) < 1e-6 for lp in lps), t  # the model's log-probability of a tied token


class _Scanned(list):
    """A list that counts the scans of its entries (membership tests, iteration)."""

    def __init__(self, items):
        super().__init__(items)
        self.scans = 0

    def __contains__(self, x):
        self.scans += 1
        return super().__contains__(x)

    def __iter__(self):
        self.scans += 1
        return super().__iter__()


def test_stop_token_ids_are_scanned_once_per_request_not_per_token():
    """A request's stop_token_ids (as the request lines, LLM.generate and the server give them: a list) become a set
    at its first token, so a long list costs one pass, not one per generated token."""
    s = Sampler(GenerationConfig(), {2}, None)
    stops = _Scanned(range(1000, 60000))
    req = Request(0, 0, prompt_token_ids=[1], stop_token_ids=stops, max_new_tokens=500)
    res = Result(req)
    assert not any(s.finished(res, tok, n) for n, tok in enumerate(range(3, 300), 1))
    assert s.finished(res, 59999, 298) and res.finish_reason == "stop"
    assert stops.scans <= 1
    s.forget(0)  # a later request under the same index has its own set
    other = Request(0, 0, prompt_token_ids=[1], stop_token_ids=[7], max_new_tokens=500)
    assert not s.finished(Result(other), 59999, 1) and s.finished(Result(other), 7, 2)
