"""The front end's proxy of the engine loop over a real socket pair: an adapter's per-adapter metric series and label
slot go when the engine's registry no longer holds it (its last request's end counted first, in the same frame; with
replicas, once none holds it);
an unload call that outlasts UNLOAD_WAIT_S answers that the unload is pending, and the engine's late reply is
dropped."""
import asyncio
import socket
import time

from tp_lora.engine.requests import Request
from tp_lora.server import engine_proxy
from tp_lora.server.channel import STOP, encode
from tp_lora.server.engine_proxy import UNLOAD_PENDING, EngineProxy
from tp_lora.server.metrics import OTHER_LABEL, AdapterLabels, Metrics


def _end(index: int) -> tuple:
    """An "ends" entry: one token, finished, with its times."""
    return index, [5], [-0.1], [], "length", None, None, {"arrival": 0.0, "first_token": 0.1, "finished": 0.2}


async def _proxy(adapters: dict) -> tuple[EngineProxy, socket.socket]:
    ours, engine = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    return EngineProxy(reader, writer, 64, adapters, Metrics()), engine


def test_an_unloaded_adapters_series_and_label_go_with_it():
    async def main():
        proxy, engine = await _proxy({"a": "/a", "b": "/b"})
        for i, name in enumerate(("a", "b", "a")):
            proxy.submit(Request(i, i, adapter=name, prompt_token_ids=[1, 2]), lambda d: None, stream=False)
        engine.sendall(encode({"ends": [_end(0), _end(1)]}))
        engine.sendall(encode({"ends": [_end(2)], "adapters": {"b": "/b"}}))  # a's last request, then a unloaded
        engine.sendall(encode(STOP))
        assert await asyncio.wait_for(proxy.run(), 10)
        engine.close()
        return proxy
    proxy = asyncio.run(main())
    text = proxy.metrics.text().decode()
    assert 'adapter="b"' in text and 'adapter="a"' not in text
    assert proxy.metrics.label.named == {"b"} and proxy.adapters == {"b": "/b"}


def test_with_replicas_an_adapter_goes_once_no_replica_holds_it():
    """Replica 1 unloads "a" while replica 0 still runs its last request: "a" stays served and labelled until
    replica 0 drops it too."""
    async def main():
        proxy, engine = await _proxy({"a": "/a", "b": "/b"})
        running = asyncio.create_task(proxy.run())
        for i in range(2):
            proxy.submit(Request(i, i, adapter="a", prompt_token_ids=[1, 2]), lambda d: None, stream=False)
        engine.sendall(encode({"ends": [_end(0)], "adapters": {"a": "/a", "b": "/b"}, "replica": 0}))
        engine.sendall(encode({"adapters": {"b": "/b"}, "replica": 1}))
        engine.sendall(encode({"ends": [_end(1)], "replica": 0}))
        for _ in range(1000):
            if not proxy.in_flight:
                break
            await asyncio.sleep(0.01)
        kept = dict(proxy.adapters), proxy.metrics.text().decode()
        engine.sendall(encode({"adapters": {"b": "/b"}, "replica": 0}))
        engine.sendall(encode(STOP))
        assert await asyncio.wait_for(running, 10)
        engine.close()
        return proxy, kept
    proxy, (kept, text) = asyncio.run(main())
    assert kept == {"a": "/a", "b": "/b"}
    assert 'tp_lora_adapter_requests_total{adapter="a"} 2.0' in text
    assert proxy.adapters == {"b": "/b"} and 'adapter="a"' not in proxy.metrics.text().decode()


def test_a_freed_label_slot_names_the_next_adapter():
    label = AdapterLabels(cap=2)
    assert [label(n) for n in ("x", "y", "z")] == ["x", "y", OTHER_LABEL]
    assert label.keep({"y", "z"}) == {"x"}
    assert label("z") == "z" and label("w") == OTHER_LABEL


def test_an_unload_outlasting_the_wait_answers_pending(monkeypatch):
    monkeypatch.setattr(engine_proxy, "UNLOAD_WAIT_S", 0.3)

    async def main():
        proxy, engine = await _proxy({"a": "/a"})
        running = asyncio.create_task(proxy.run())
        t0 = time.monotonic()
        err = await asyncio.wait_for(proxy.call("unload", "a"), 10)
        waited = time.monotonic() - t0
        engine.sendall(encode({"replies": [(0, None)]}))  # the engine's answer once the last request ended
        engine.sendall(encode(STOP))
        assert await asyncio.wait_for(running, 10)
        engine.close()
        return err, waited
    err, waited = asyncio.run(main())
    assert err.endswith(UNLOAD_PENDING) and "'a' is still in use after 0.3 s" in err, err
    assert 0.3 <= waited < 5
