"""launch/serve.py's job: an OpenAI-compatible HTTP server over the TP engine. run(RunConfig) -> exit code.

Every rank runs the engine loop (tp_lora.server.loop) in its main thread, where the signal handlers and the
collectives live, as in the offline job; rank 0 also runs uvicorn in a thread: its event loop only parses, queues
and streams, and a step never waits for HTTP. Exit codes as tp_lora.app: 0 (stopped by SIGTERM / Ctrl-C after
draining), 2 bad config or inputs, 3 lost the other ranks.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from tp_lora import distributed as comm
from tp_lora.app import EXIT_BAD_INPUT, EXIT_LOST_RANKS, LOST_RANKS_EXIT_S, StopSignals, is_comm_failure, log
from tp_lora.config import ConfigError, RunConfig

HTTP_START_S = 30.0  # uvicorn binding its port
HTTP_STOP_S = 10.0  # uvicorn sending the last responses after the engine loop ended


def run(cfg: RunConfig) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        if world_size != cfg.parallel.tp_size:
            raise ConfigError(f"the server runs one tensor-parallel group: launch parallel.tp_size="
                              f"{cfg.parallel.tp_size} processes, not {world_size} (data-parallel replicas are not "
                              f"served)")
        from tp_lora.api import LLM
        llm = LLM.from_config(cfg)
        try:
            return _serve(llm, cfg)
        finally:
            llm.engine.close()
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"[tp_lora] rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except Exception as e:
        if world_size > 1 and is_comm_failure(e):
            timer = threading.Timer(LOST_RANKS_EXIT_S, os._exit, args=(EXIT_LOST_RANKS,))
            timer.daemon = True
            timer.start()
            return EXIT_LOST_RANKS
        raise
    finally:
        comm.shutdown()


def model_name(cfg: RunConfig, model_dir: str) -> str:
    if cfg.server.model_name:
        return cfg.server.model_name
    return "tiny-llama" if cfg.model.path is None else os.path.basename(os.path.normpath(model_dir))


def _serve(llm, cfg: RunConfig) -> int:
    from tp_lora.server.loop import ServingLoop
    engine, tp = llm.engine, llm.ps.tp
    driver = tp.rank == 0
    loop = ServingLoop(engine, tp)
    http, error = None, None
    if driver:
        http, error = _start_http(loop, llm, cfg)
    # Every rank learns whether rank 0 is listening before any waits for its control messages.
    error = comm.broadcast_object(error, tp)
    if error:
        raise ConfigError(error)
    if driver:
        log(f"serving {model_name(cfg, llm.model_dir)!r} and {len(engine.adapters)} adapters at "
            f"http://{cfg.server.host}:{http.port} (tp={tp.size}, context {loop.context} tokens)")
    # The handlers stay through the teardown: a signal then (torchrun stopping the ranks) does not cut it short.
    with StopSignals(announce=driver) as stop:
        try:
            loop.run(stop, cfg.scheduler.stop_grace_s)
        except Exception as e:
            if tp.size > 1 and is_comm_failure(e):  # said at once, before the teardown
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                print(f"[tp_lora] rank {tp.rank}: error: lost the other ranks: a rank died or a collective did not "
                      f"complete within parallel.timeout_s={cfg.parallel.timeout_s:g}s ({type(e).__name__}: "
                      f"{first[:300]}); the server stops", file=sys.stderr, flush=True)
            raise
        finally:
            engine.close_run()
            if http is not None:
                http.stop()
    if driver:
        log("stopped")
    return 0


class HttpThread:
    """uvicorn serving the FastAPI app in a daemon thread."""

    def __init__(self, app, host: str, port: int):
        import uvicorn
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=HTTP_STOP_S, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="http", daemon=True)
        self.port = port

    def start(self) -> None:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive():
                raise OSError("the HTTP server did not start (see the error above; is the port in use?)")
            if time.monotonic() - t0 > HTTP_START_S:
                raise OSError(f"the HTTP server did not start within {HTTP_START_S:g}s")
            time.sleep(0.02)
        if self.port == 0:  # the port the OS picked
            self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(HTTP_STOP_S + 5)


def _start_http(loop, llm, cfg: RunConfig):
    """(the running HttpThread, None) or (None, why it could not start)."""
    try:
        from tp_lora.server.http import Frontend, make_app
        fe = Frontend(loop, llm.tokenizer, model_name(cfg, llm.model_dir), llm.model_dir, cfg)
        loop.on_step = fe.metrics.update
        http = HttpThread(make_app(fe), cfg.server.host, cfg.server.port)
        http.start()
        return http, None
    except (ImportError, OSError) as e:
        hint = " (pip install 'tp_lora[serve]')" if isinstance(e, ImportError) else ""
        return None, f"server: {e}{hint}"
