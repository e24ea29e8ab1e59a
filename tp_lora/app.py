"""The main job behind launch/generate.py, callable without Hydra: run(RunConfig) -> exit code.

Exit codes as tp_lora.lifecycle: 0 done; 2 bad config or inputs; 3 lost the other ranks; 130 stopped by a signal
before every request finished (the output file holds the finished ones; resume=true runs the rest).
"""
from __future__ import annotations

import os
import sys
import time

from tp_lora import distributed as comm
from tp_lora.config import ConfigError, RunConfig
from tp_lora.lifecycle import (EXIT_BAD_INPUT, EXIT_STOPPED, StopSignals, exit_lost_ranks, is_comm_failure, log,
                               report_lost_ranks)


def run(cfg: RunConfig) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        requests_path = _requests_path(cfg)
        return _generate(cfg, requests_path)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"[tp_lora] rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except Exception as e:
        if world_size > 1 and is_comm_failure(e):
            report_lost_ranks(rank, cfg.parallel.timeout_s, e,
                              f". Finished requests are in {cfg.output}; resume=true runs the rest.")
            return exit_lost_ranks()
        raise
    finally:
        comm.shutdown()


def _requests_path(cfg: RunConfig) -> str:
    """The requests file: the embedded default's for the embedded default model."""
    if cfg.model.path is not None and cfg.requests is None:
        raise ConfigError("model.path is set, so requests=FILE.jsonl is needed too (the embedded default requests "
                          "are for the embedded default model)")
    if cfg.requests is not None:
        if not os.path.exists(cfg.requests):
            raise FileNotFoundError(f"requests={cfg.requests!r} does not exist")
        return cfg.requests
    from tp_lora.assets import ensure_default_assets
    return ensure_default_assets()["requests"]


def _generate(cfg: RunConfig, requests_path: str) -> int:
    from tp_lora.api import LLM
    from tp_lora.request_files import OutputWriter, read_output_lines, read_requests, split_answered

    t0 = time.perf_counter()
    llm = LLM.from_config(cfg)
    engine, ps, model_dir = llm.engine, llm.ps, llm.model_dir
    requests = read_requests(requests_path, cfg.generation.max_new_tokens, llm.tokenizer)
    driver = ps.is_driver
    parts = [_part_path(cfg.output, r) for r in range(ps.dp.size)] if ps.dp.size > 1 else []
    kept = []
    if cfg.resume:
        # The driver's file decides, for every rank alike (other nodes may not see it).
        answered = None
        if driver:
            lines = read_output_lines(cfg.output) + [ln for p in parts for ln in read_output_lines(p)]
            _, kept = split_answered(requests, lines)
            answered = sorted({int(i) for i, _ in kept if i != float("inf")})
        answered = set(comm.broadcast_object(answered, ps.world))
        requests_todo = [r for r in requests if r.index not in answered]
        if driver:
            log(f"resume: {len(answered)} of {len(requests)} requests already answered in {cfg.output}")
    else:
        requests_todo = requests
    mine = llm.shard(requests_todo)  # data-parallel replicas split the work
    if ps.dp.size == 1:
        writer = OutputWriter(cfg.output, enabled=driver, keep=kept)
    else:  # each replica's first rank appends to its own part file; the driver merges them at the end
        writer = OutputWriter(parts[ps.dp.rank], enabled=ps.tp.rank == 0, ordered=False)
    every = max(1, len(mine) // 10)

    def progress(done: int, total: int) -> None:
        if driver and cfg.progress and (done % every == 0 or done == total) and total >= 20:
            log(f"{done}/{total} requests done")

    if driver:
        n_ad = len(engine.adapters)
        log(f"model {model_dir} ({engine.hf.get('model_type')}, {engine.hf['num_hidden_layers']} layers), "
            f"{n_ad} adapters{f', {len(engine.bad_adapters)} unusable' if engine.bad_adapters else ''}, "
            f"tp={ps.tp.size} dp={ps.dp.size} lora={'fully_sharded' if cfg.lora.fully_sharded else 'default'}, "
            f"device={ps.device} dtype={str(engine.dtype).replace('torch.', '')}, load {time.perf_counter() - t0:.1f}s")
    try:
        with StopSignals(announce=driver) as stop:
            results = engine.generate(mine, on_result=writer.write, progress=progress, stop=stop)
    finally:
        engine.close()
        writer.close()
    done = [r for r in results if not r.interrupted]
    if ps.dp.size > 1:  # replicas send their results to the driver, which writes the file in request order
        gathered = comm.all_gather_object([r.to_json() | {"_index": r.request.index} for r in done], ps.dp)
        if driver:
            lines = [(ln.pop("_index"), ln) for part in gathered for ln in part]
            OutputWriter(cfg.output, keep=kept + lines).close()
            for p in parts:
                if os.path.exists(p):
                    os.remove(p)
    s = engine.stats
    interrupted = len(results) - len(done)
    if driver:
        errors = sum(1 for r in done if r.error)
        tps = s.generated_tokens / s.seconds if s.seconds else 0.0
        reads = engine.gauges().adapter_reads
        log(f"{len(done)} requests ({errors} failed), {s.prompt_tokens} prompt + {s.generated_tokens} generated "
            f"tokens in {s.seconds:.2f}s ({tps:.1f} generated tokens/s on this replica), {s.steps} steps, "
            f"{s.adapter_loads} adapter loads (slot hit rate {s.slot_hit_rate:.0%}, {reads} disk reads), prefix "
            f"cache hit rate {s.prefix_hit_rate:.0%} ({s.prefix_hit_tokens} prompt tokens reused) "
            f"-> {cfg.output}")
        if interrupted:
            log(f"stopped: {interrupted} requests not run or not finished; {cfg.output} holds the "
                f"{len(done) + len(kept)} answered; rerun with resume=true to finish")
    return EXIT_STOPPED if interrupted else 0


def _part_path(output: str, replica: int) -> str:
    return f"{output}.dp{replica}.part"
