"""The main job behind launch/generate.py, callable without Hydra: run(RunConfig) -> exit code."""
from __future__ import annotations

import os
import sys
import time

from tp_lora import distributed as comm
from tp_lora.config import ConfigError, RunConfig, resolve_device, validate


def log(msg: str) -> None:
    print(f"[tp_lora] {msg}", flush=True)


def run(cfg: RunConfig) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        # Everything that can be wrong with the config or files is found here, on every rank, before any
        # collective: a bad value ends every rank with the same message instead of leaving peers waiting.
        validate(cfg, world_size)
        device = resolve_device(cfg.device)
        model_dir, adapter_dir, requests_path = _resolve_inputs(cfg)
        ps = comm.init_parallel(cfg.parallel.tp_size, device, cfg.parallel.timeout_s)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"[tp_lora] rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        return _generate(cfg, ps, model_dir, adapter_dir, requests_path)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"[tp_lora] rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        comm.shutdown()


def _resolve_inputs(cfg: RunConfig) -> tuple[str, str | None, str]:
    """Paths the run reads; the embedded default (tiny Llama, adapters, requests) fills in what is not given."""
    if cfg.model.path is not None and cfg.requests is None:
        raise ConfigError("model.path is set, so requests=FILE.jsonl is needed too (the embedded default requests "
                          "are for the embedded default model)")
    default = None
    if cfg.model.path is None:
        from tp_lora.assets import ensure_default_assets
        default = ensure_default_assets()
    model_dir = cfg.model.path or default["model"]
    adapter_dir = cfg.lora.adapter_dir or (default["adapter_dir"] if default else None)
    requests_path = cfg.requests or default["requests"]
    for what, path in (("model.path", model_dir), ("lora.adapter_dir", adapter_dir), ("requests", requests_path)):
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"{what}={path!r} does not exist")
    return model_dir, adapter_dir, requests_path


def _generate(cfg: RunConfig, ps: comm.ParallelState, model_dir: str, adapter_dir: str | None,
              requests_path: str) -> int:
    from tp_lora.engine.engine import Engine
    from tp_lora.engine.requests import OutputWriter, read_requests
    from tp_lora.engine.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    engine = Engine(cfg, ps, model_dir, adapter_dir)
    requests = read_requests(requests_path, cfg.generation.max_new_tokens, load_tokenizer(model_dir))
    mine = [r for r in requests if r.index % ps.dp.size == ps.dp.rank]  # data-parallel replicas split the work
    driver = ps.is_driver
    writer = OutputWriter(cfg.output, enabled=driver and ps.dp.size == 1)
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
        results = engine.generate(mine, on_result=writer.write, progress=progress)
    finally:
        engine.close()
    if ps.dp.size > 1:  # replicas send their results to the driver, which writes the file in request order
        gathered = comm.all_gather_object([r.to_json() | {"_index": r.request.index} for r in results], ps.dp)
        if driver:
            lines = sorted((ln for part in gathered for ln in part), key=lambda ln: ln.pop("_index"))
            _write_lines(cfg.output, lines)
    writer.close()
    if driver:
        s = engine.stats
        errors = sum(1 for r in results if r.error)
        tps = s.generated_tokens / s.seconds if s.seconds else 0.0
        log(f"{len(requests)} requests ({errors} failed), {s.prompt_tokens} prompt + {s.generated_tokens} generated "
            f"tokens in {s.seconds:.2f}s ({tps:.1f} generated tokens/s on this replica), {s.steps} steps, "
            f"{s.adapter_loads} adapter loads -> {cfg.output}")
    return 0


def _write_lines(path: str, lines: list[dict]) -> None:
    import json
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
