"""Adapter-affinity routing over data-parallel replicas (issue #28): a trace of requests over many adapters with
power-law popularity, served by `launch/serve.py parallel.dp_size=N` (the launch starts its ranks) under each
server.routing policy; per policy the slot hit rate, adapter reads (disk -> host memory), slot loads (host -> device
slots: the slot misses), completed requests, and how often a replica sat idle while another queued.

    python scripts/bench_routing.py                                  # CPU: the embedded tiny model, dp 2 and 4
    python scripts/bench_routing.py --dp 2,4,8 --model DIR --adapter DIR --requests 4000 --concurrency 128  # GPUs

--adapter: one PEFT adapter dir, copied (linked) --adapters times as the served adapters (default: the embedded
default's alpha). The counters are what matter: on CPU the step times are not representative. Last, per replica
count, the floor of slot misses that popularity alone sets (slot_miss_floor) and so the most any policy could cut
round robin's misses by.
"""
import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
POLICIES = ("affinity", "least_loaded", "round_robin")


def make_adapters(src: str, n: int, root: str) -> str:
    """n adapters named a0000.. whose files link to src's."""
    out = os.path.join(root, "adapters")
    os.makedirs(out, exist_ok=True)
    for i in range(n):
        d = os.path.join(out, f"a{i:04d}")
        os.makedirs(d, exist_ok=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            if not os.path.exists(os.path.join(d, f)):
                os.symlink(os.path.join(os.path.abspath(src), f), os.path.join(d, f))
    return out


def trace(n_requests: int, n_adapters: int, alpha: float, seed: int) -> list[str]:
    """Adapter names drawn with popularity proportional to 1 / rank^alpha."""
    p = 1.0 / np.arange(1, n_adapters + 1) ** alpha
    rng = np.random.default_rng(seed)
    return [f"a{i:04d}" for i in rng.choice(n_adapters, size=n_requests, p=p / p.sum())]


def slot_miss_floor(n_adapters: int, alpha: float, slots: int) -> float:
    """The least slot-miss rate any routing and eviction can reach in the long run when requests draw adapters
    independently with this popularity: the replicas' slots together hold at most `slots` distinct adapters, so at
    best the most popular `slots` of them are always resident and every other request misses."""
    p = 1.0 / np.arange(1, n_adapters + 1) ** alpha
    return float(1 - p[:slots].sum() / p.sum())


def series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(rf"{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


class Watch(threading.Thread):
    """Samples /metrics: how many samples saw a replica idle (nothing running or queued) while another queued more
    than the imbalance bound."""

    def __init__(self, url: str, bound: int):
        super().__init__(daemon=True)
        self.url, self.bound, self.samples, self.idle_while_queued, self.done = url, bound, 0, 0, False

    def run(self):
        while not self.done:
            try:
                text = httpx.get(self.url + "/metrics", timeout=5).text
            except httpx.HTTPError:
                break
            queue = series(text, "tp_lora_replica_queue_length")
            running = series(text, "tp_lora_replica_running")
            idle = [k for k in queue if queue[k] == 0 and running.get(k, 0) == 0]
            self.samples += 1
            self.idle_while_queued += bool(idle) and max(queue.values(), default=0) > self.bound
            time.sleep(0.2)


async def drive(url: str, names: list[str], concurrency: int, max_tokens: int) -> int:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        async def one(i, name):
            async with sem:
                r = await c.post("/v1/completions", json={"model": name, "prompt": [1 + i % 50, 17, 42, 99],
                                                          "max_tokens": max_tokens, "temperature": 0,
                                                          "ignore_eos": True})
                return r.status_code == 200
        return sum(await asyncio.gather(*[one(i, n) for i, n in enumerate(names)]))


def serve_once(args, dp: int, policy: str, adapters: str, names: list[str], log_path: str) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "launch", "serve.py"), "parallel=dp2", f"parallel.dp_size={dp}",
           f"parallel.tp_size={args.tp}", f"lora.adapter_dir={adapters}", f"lora.max_loras={args.slots}",
           f"lora.max_cpu_loras={args.host}", f"server.routing={policy}", "server.port=0",
           f"server.max_imbalance={args.max_imbalance}", f"scheduler.max_batch_size={args.batch}",
           f"server.max_queue={len(names)}", "progress=false"] + ([f"model.path={args.model}"] if args.model else [])
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        url, deadline = None, time.monotonic() + 600
        while url is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{open(log_path).read()[-3000:]}")
            m = re.search(r"at (http://\S+) \(", open(log_path).read())
            url = m.group(1) if m else None
            time.sleep(0.5)
        watch = Watch(url, args.max_imbalance)
        watch.start()
        t0 = time.perf_counter()
        ok = asyncio.run(drive(url, names, args.concurrency, args.max_tokens))
        seconds = time.perf_counter() - t0
        watch.done = True
        watch.join()
        text = httpx.get(url + "/metrics", timeout=10).text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    reads = sum(series(text, "tp_lora_replica_adapter_reads").values())
    loads = sum(series(text, "tp_lora_replica_adapter_loads").values())
    finished = series(text, "tp_lora_requests_total").get('{status="finished"}', 0)
    return {"dp": dp, "policy": policy, "requests": len(names), "completed": ok, "finished": int(finished),
            "adapter_reads": int(reads), "slot_loads": int(loads),
            "slot_hit_rate": round(1 - loads / max(finished, 1), 3), "seconds": round(seconds, 1),
            "idle_while_queued": f"{watch.idle_while_queued}/{watch.samples}"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", default="2,4", help="replica counts")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--model", default=None, help="model dir (default: the embedded tiny model)")
    ap.add_argument("--adapter", default=None, help="PEFT adapter dir copied as every adapter")
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--alpha", type=float, default=1.0, help="power-law exponent of adapter popularity")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8, help="lora.max_loras per replica")
    ap.add_argument("--host", type=int, default=64, help="lora.max_cpu_loras per replica")
    ap.add_argument("--batch", type=int, default=16, help="scheduler.max_batch_size")
    ap.add_argument("--max-imbalance", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON lines of the rows")
    args = ap.parse_args()
    src = args.adapter
    if src is None:
        from tp_lora.assets import ensure_default_assets
        src = os.path.join(ensure_default_assets()["adapter_dir"], "alpha")
    tmp = tempfile.mkdtemp(prefix="bench_routing_")
    adapters = make_adapters(src, args.adapters, tmp)
    names = trace(args.requests, args.adapters, args.alpha, args.seed)
    print(f"{args.requests} requests over {len(set(names))} of {args.adapters} adapters (power law {args.alpha}), "
          f"{args.concurrency} concurrent, {args.slots} slots and {args.host} host images per replica", flush=True)
    print("| dp | routing | completed | adapter reads | slot loads (misses) | slot hit rate | idle while another "
          "queued (samples) | seconds |\n|---|---|---|---|---|---|---|---|", flush=True)
    floors = []
    for dp in [int(x) for x in args.dp.split(",")]:
        rows = {}
        for policy in args.policies.split(","):
            row = rows[policy] = serve_once(args, dp, policy, adapters, names,
                                            os.path.join(tmp, f"dp{dp}_{policy}.log"))
            print(f"| {dp} | {policy} | {row['completed']}/{row['requests']} | {row['adapter_reads']} | "
                  f"{row['slot_loads']} | {row['slot_hit_rate']:.3f} | {row['idle_while_queued']} | "
                  f"{row['seconds']} |", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        floor = slot_miss_floor(args.adapters, args.alpha, args.slots * dp)
        rr = rows.get("round_robin")
        floors.append(f"dp {dp}: slot misses at best {floor:.3f} of requests"
                      + (f", round robin's {rr['slot_loads'] / len(names):.3f}: at most "
                         f"{rr['slot_loads'] / len(names) / floor:.2f}x fewer than round robin" if rr else ""))
    print("Floor (any routing, any eviction; popularity alone): " + "; ".join(floors))


if __name__ == "__main__":
    main()
