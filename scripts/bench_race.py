"""The token draw's race alone (tp_lora.ops.sampling), greedy and hot rows: over gathered float32 logits [rows, vocab]
(plain rows, then with every other row under a grammar bitmask) and one TP rank's part of the draw from vocabulary
shards (race_shard over its [rows, vocab / tp] shard, then race_combine of tp ranks' parts; the parts' exchange is not
included), against the floor of reading those logits once at the measured copy bandwidth.

    python scripts/bench_race.py --out bench_results/race             # GPU: graphed replays, medians
    python scripts/bench_race.py --rows 2 --vocab 512 --reps 3        # CPU: the torch references (smoke)

Prints a table, writes bench_race.json into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_moe_plan import timed_us  # noqa: E402 - this directory's (scripts/)
from bench_step import copy_bandwidth  # noqa: E402
from tp_lora.ops import sampling  # noqa: E402


def grammar_inputs(rows: int, vocab: int, gen: torch.Generator, device) -> tuple[torch.Tensor, ...]:
    """Two random bitmask rows (about half the tokens each), every other row under one of them, two stop tokens."""
    width = (vocab + 31) // 32
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, width), dtype=torch.int32, generator=gen)
    where = torch.tensor([(-1, 0, -1, 1)[i % 4] for i in range(rows)], dtype=torch.int32)
    stops = torch.zeros(width, dtype=torch.int32)
    stops[0] = 0b110
    allow = torch.stack([torch.full((width,), -1, dtype=torch.int32), stops])
    return words.to(device), where.to(device), allow.to(device)


def cases(rows: int, vocab: int, tp: int, temp: float, gen: torch.Generator, device):
    """(name, fn) of each draw over [rows, vocab] float32 logits at temperature temp."""
    x = torch.randn(rows, vocab, generator=gen).to(device)
    temps = torch.full((rows,), temp, device=device)
    keys = torch.randint(0, 1 << 32, (rows,), generator=gen).to(device)
    words, where, allow = grammar_inputs(rows, vocab, gen, device)
    shard = x[:, :vocab // tp].contiguous()
    return [("race", lambda: sampling.race(x, None, temps, keys, None, None, None)),
            ("race, grammar rows", lambda: sampling.race(x, None, temps, keys, words, where, allow)),
            (f"shard 1/{tp} + combine", lambda: sampling.race_combine(
                torch.cat([sampling.race_shard(shard, temps, keys, 0)] * tp)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,32,256")
    p.add_argument("--vocab", default="151936,128256,32000")
    p.add_argument("--temperatures", default="0,0.8")
    p.add_argument("--tp", type=int, default=2, help="the shard case's TP ranks")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", default="bench_results/race")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    bandwidth = copy_bandwidth(device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in [int(v) for v in args.rows.split(",")]:
        for vocab in [int(v) for v in args.vocab.split(",")]:
            for temp in [float(v) for v in args.temperatures.split(",")]:
                row = dict(rows=n, vocab=vocab, temperature=temp)
                for name, fn in cases(n, vocab, args.tp, temp, gen, device):
                    row[name] = round(timed_us(fn, args.reps, 1, cuda), 2)
                row["floor_us"] = round(n * vocab * 4 / bandwidth * 1e6, 2) if cuda else None
                rows.append(row)
                print(json.dumps(row), flush=True)
    names = [k for k in rows[0] if k not in ("rows", "vocab", "temperature", "floor_us")]
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; µs")
    print("| rows | vocab | T | " + " | ".join(names) + " | floor (logits read once) |")
    print("|---" * (len(names) + 4) + "|")
    for r in rows:
        print(f"| {r['rows']} | {r['vocab']} | {r['temperature']} | " + " | ".join(str(r[k]) for k in names) +
              f" | {r['floor_us']} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_race.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if cuda else "cpu", bandwidth=bandwidth, rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
