"""The HTTP front-end process: `python -m tp_lora.server.frontend_process FD`, started by rank 0 (FrontendProcess) and
talking to its engine loop over a Unix socket pair (tp_lora.server.channel). It runs uvicorn with the FastAPI app
(tp_lora.server.http) in its own interpreter, so parsing, tokenizing, detokenizing and the JSON / SSE work of many
streams never take the GIL from the step loop.

Life cycle: rank 0 spawns it first thing (its imports overlap the model's load); once the engine is up rank 0 sends
the start frame (config, model name, context, adapters), the front end binds its port and answers ("ready", port) or
("error", why). It ignores SIGINT / SIGTERM (rank 0 handles them and drains): it ends when rank 0 sends STOP (after
sending the last responses), and at once when rank 0 is gone (the socket's EOF, or its parent pid changes).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Optional

from tp_lora.server.channel import STOP, EngineEnd, encode, read_frame_blocking

HTTP_START_S = 60.0  # the front end binding its port and starting uvicorn, after the start frame
HTTP_STOP_S = 10.0  # uvicorn sending the last responses after the engine loop ended
LOST_EXIT_S = 3.0  # rank 0 gone: the front end's open responses end with an error, then it exits within this
PARENT_CHECK_S = 0.5


class FrontendProcess:
    """Rank 0's handle on the front-end process."""

    def __init__(self):
        import tp_lora
        root = os.path.dirname(os.path.dirname(os.path.abspath(tp_lora.__file__)))
        # glibc: buffers of 1 MB and more always mapped apart and unmapped when freed (by default the threshold
        # grows to the largest freed, and request bodies then stay in the process's heap after they are gone)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
                   MALLOC_MMAP_THRESHOLD_="1048576")
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tp_lora.server.frontend_process", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.sock = mine
        self.link: Optional[EngineEnd] = None
        self.port: Optional[int] = None

    def start(self, info: dict) -> Optional[str]:
        """Send the start frame and wait for the port to be bound: None, or why the front end did not start."""
        self.sock.settimeout(HTTP_START_S)
        try:
            try:
                self.sock.sendall(encode(info))
            except OSError:
                pass  # it exited: its error frame, if any, is still to be read
            reply = read_frame_blocking(self.sock)
        except (EOFError, ConnectionError):  # it closed its end: it is exiting
            try:
                code = f" with code {self.proc.wait(5)}"
            except subprocess.TimeoutExpired:
                code = ""
            return f"server: the HTTP front end exited{code} before serving (see its error above)"
        except OSError as e:  # the timeout included
            return f"server: the HTTP front end did not start within {HTTP_START_S:g}s ({type(e).__name__}: {e})"
        if reply[0] != "ready":
            return reply[1]
        self.port = reply[1]
        self.link = EngineEnd(self.sock)
        return None

    def stop(self) -> Optional[int]:
        """Tell the front end the engine loop is over, let it send its last responses, and reap it (killed when it
        does not end in time, or at once when it never served). Its exit code."""
        if self.link is not None:
            self.link.send(STOP)
            self.link.drain_out(HTTP_STOP_S)
        else:
            self.proc.kill()
        self.sock.close()
        try:
            return self.proc.wait(HTTP_STOP_S + 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# ---- the front-end process ---------------------------------------------------------------------------------------
def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, Nagle's algorithm off for the connections it accepts (they inherit TCP_NODELAY): asyncio
    turns it off only on sockets made with proto IPPROTO_TCP, which create_server's are not, and with it on each
    streamed token after the first waits for the client's delayed ACK."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def main(fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    sock = socket.socket(fileno=fd)
    try:
        import uvicorn  # noqa: F401
        from tp_lora.server.http import OpenAIFrontend, make_app  # noqa: F401
    except ImportError as e:
        sock.sendall(encode(("error", f"server: {e} (pip install 'tp_lora[serve]')")))
        return 1
    try:
        info = read_frame_blocking(sock)
    except (EOFError, OSError):
        return 0  # rank 0 ended before serving
    return asyncio.run(_serve(sock, info, parent))


async def _serve(sock: socket.socket, info: dict, parent: int) -> int:
    import uvicorn
    from tp_lora.engine.tokenizer import load_tokenizer
    from tp_lora.server.engine_proxy import EngineProxy
    from tp_lora.server.guard import timed_h11
    from tp_lora.server.http import OpenAIFrontend, make_app
    from tp_lora.server.metrics import Metrics

    class Server(uvicorn.Server):
        """uvicorn without its signal handlers: rank 0 handles the signals and says when to stop."""
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    cfg = info["cfg"]
    try:
        listen = bind_listener(cfg.server.host, cfg.server.port)
    except OSError as e:
        sock.sendall(encode(("error", f"server: cannot listen on {cfg.server.host}:{cfg.server.port}: {e}")))
        return 1
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    engine = EngineProxy(reader, writer, info["context"], info["adapters"], Metrics())
    fe = OpenAIFrontend(engine, load_tokenizer(info["model_dir"]), info["model_name"], info["model_dir"], cfg,
                        info["lora_roots"])
    server = Server(uvicorn.Config(make_app(fe), log_level="warning", access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=HTTP_STOP_S, http=timed_h11(cfg.server.header_timeout_s),
                                   limit_concurrency=cfg.server.max_connections))
    serving = asyncio.create_task(server.serve(sockets=[listen]))
    while not server.started:
        if serving.done():
            writer.write(encode(("error", "server: the HTTP server did not start (see the error above)")))
            await writer.drain()
            return 1
        await asyncio.sleep(0.01)
    writer.write(encode(("ready", listen.getsockname()[1])))
    await writer.drain()
    engine.linked = True  # /health answers 200 only now: a client that saw it cannot have beaten the ready frame
    engine_ended = asyncio.create_task(engine.run())
    parent_gone = asyncio.create_task(_parent_gone(parent))
    await asyncio.wait([engine_ended, parent_gone], return_when=asyncio.FIRST_COMPLETED)
    lost = parent_gone.done() or not engine_ended.result()
    if lost:  # rank 0 is gone: the open requests end with an error now; exit soon whatever the clients do
        engine.close()
        timer = threading.Timer(LOST_EXIT_S, os._exit, args=(1,))
        timer.daemon = True
        timer.start()
    engine_ended.cancel()
    parent_gone.cancel()
    server.should_exit = True
    await serving
    return 1 if lost else 0


async def _parent_gone(parent: int) -> None:
    """Returns when the process that started this one is no longer its parent (it died)."""
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_S)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
