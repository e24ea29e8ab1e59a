"""The OpenAI-compatible server behind launch/serve.py: every rank runs the engine loop (serve.py, loop.py); rank 0
starts the HTTP front end in a process of its own (frontend_process.py: uvicorn over http.py and engine_proxy.py) and
talks to it through a local channel (channel.py). Light to import: the front-end process imports this package without
torch."""
