"""launch/serve.py's job: an OpenAI-compatible HTTP server over the engine in any parallel layout (one TP group, or
data-parallel replicas of TP groups, EP over them included). run(RunConfig) -> exit code.

Every rank runs the engine loop (tp_lora.server.loop) in its main thread, where the signal handlers and the
collectives live, as in the offline job; global rank 0 also starts the HTTP front end in a process of its own
(tp_lora.server.frontend_process) and hands requests and tokens to and from it through a local channel, so a step
never waits for HTTP. Exit codes as tp_lora.lifecycle: 0 (stopped by SIGTERM / Ctrl-C after draining), 2 bad config
or inputs, 3 lost the other ranks, 1 the front-end process died.
"""
from __future__ import annotations

import os
import subprocess
import sys

from tp_lora import distributed as comm
from tp_lora.config import ConfigError, RunConfig
from tp_lora.lifecycle import (EXIT_BAD_INPUT, StopSignals, exit_lost_ranks, gone_ranks, is_comm_failure, log,
                               report_lost_ranks, whereabouts)

EXIT_FRONTEND_LOST = 1


def run(cfg: RunConfig) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        from tp_lora.api import LLM
        from tp_lora.server.frontend_process import FrontendProcess
        front = FrontendProcess() if rank == 0 else None  # first: its imports overlap the model's load
        try:
            llm = LLM.from_config(cfg)
            try:
                return _serve(llm, cfg, front)
            finally:
                llm.engine.close()
        finally:
            if front is not None:
                front.stop()
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"[tp_lora] rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except Exception as e:
        if world_size > 1 and is_comm_failure(e):
            return exit_lost_ranks()
        raise
    finally:
        comm.shutdown()


def model_name(cfg: RunConfig, model_dir: str) -> str:
    if cfg.server.model_name:
        return cfg.server.model_name
    return "tiny-llama" if cfg.model.path is None else os.path.basename(os.path.normpath(model_dir))


def _serve(llm, cfg: RunConfig, front) -> int:
    from tp_lora.server.loop import ServingLoop
    engine, ps = llm.engine, llm.ps
    world = ps.world
    driver = world.rank == 0
    loop = ServingLoop(engine, ps, cfg.server.routing, cfg.server.max_imbalance)
    peers = []
    try:
        error = None
        if driver:
            roots = cfg.server.lora_roots or ([llm.adapter_dir] if llm.adapter_dir else [])
            error = front.start(dict(cfg=cfg, model_name=model_name(cfg, llm.model_dir), model_dir=llm.model_dir,
                                     context=loop.context, adapters=loop.adapter_registry(),
                                     lora_roots=[os.path.realpath(r) for r in roots]))
            loop.link = front.link
        # Every rank learns whether rank 0 is listening before any waits for its control messages, and where the
        # others run (to name a rank that dies).
        error, peers = comm.broadcast_object(error, world), comm.all_gather_object(whereabouts(), world)
        if error:
            raise ConfigError(error)
        if driver:
            log(f"serving {model_name(cfg, llm.model_dir)!r} and {len(engine.adapters)} adapters at "
                f"http://{cfg.server.host}:{front.port} (tp={ps.tp.size}"
                + (f", {ps.dp.size} replicas routed by {cfg.server.routing}" if ps.dp.size > 1 else "")
                + f", context {loop.context} tokens)")
        # The handlers stay through the teardown: a signal then (torchrun stopping the ranks) does not cut it short.
        with StopSignals(announce=driver) as stop:
            try:
                loop.run(stop)
            finally:
                engine.close_run()
    except Exception as e:
        if world.size > 1 and is_comm_failure(e):  # said at once, before the teardown
            report_lost_ranks(world.rank, cfg.parallel.timeout_s, e, "; the server stops",
                              gone_ranks(peers) if peers else None)
        raise
    if loop.frontend_lost:
        try:
            code = front.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = "not yet known"
        print(f"[tp_lora] rank 0: error: the HTTP front-end process exited (code {code}); the server stops",
              file=sys.stderr, flush=True)
        return EXIT_FRONTEND_LOST
    if driver:
        log("stopped")
    return 0
