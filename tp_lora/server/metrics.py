"""The server's Prometheus metrics (GET /metrics), in a registry of their own in the front-end process: counters
from the results it receives, gauges from the values the engine loop sends with its steps. With data-parallel
replicas each replica's values come tagged with it: the unlabelled gauges are their sums (the slot hit rate their
mean), and tp_lora_replica_* carry each replica's queue, running batch, slot hit rate, adapter reads and loads."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tp_lora.engine.requests import Result
from tp_lora.server.channel import STEP_FIELDS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MAX_ADAPTER_LABELS = 100  # adapters named in per-adapter series at once (first seen first); the rest count as "other"
BASE_LABEL = "base"  # requests without an adapter
OTHER_LABEL = "other"


class AdapterLabels:
    """An adapter's label in per-adapter series: its name for the first MAX_ADAPTER_LABELS names seen among the
    loaded adapters, else "other", so the series stay bounded whatever the number of adapters (an unloaded adapter's
    label is freed: keep())."""

    def __init__(self, cap: int = MAX_ADAPTER_LABELS):
        self.cap, self.named = cap, set()

    def __call__(self, adapter) -> str:
        if adapter is None:
            return BASE_LABEL
        if adapter in self.named:
            return adapter
        if len(self.named) < self.cap:
            self.named.add(adapter)
            return adapter
        return OTHER_LABEL

    def keep(self, loaded) -> set[str]:
        """Free the labels of the adapters not in `loaded`; returns those names."""
        gone = self.named.difference(loaded)
        self.named -= gone
        return gone


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tp_lora_requests", "Requests by how they ended (finished, error, cancelled, "
                                "rejected before reaching the engine)", ["status"], registry=r)
        self.prompt_tokens = Counter("tp_lora_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("tp_lora_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.ttft = Histogram("tp_lora_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tp_lora_time_per_output_token_seconds", "First to last token, per later token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("tp_lora_queue_length", "Requests waiting for admission", registry=r)
        self.running = Gauge("tp_lora_running", "Sequences in the running batch", registry=r)
        self.slot_hit_rate = Gauge("tp_lora_slot_hit_rate", "Admissions that found their adapter in a device slot",
                                   registry=r)
        self.adapter_reads = Gauge("tp_lora_adapter_reads", "Adapter reads from disk into host memory", registry=r)
        self.adapter_loads = Gauge("tp_lora_adapter_loads", "Adapter copies into device slots", registry=r)
        self.kv_blocks = Gauge("tp_lora_kv_blocks", "KV cache blocks: held by running sequences (used), in the prefix "
                               "cache and held by none (cached, evictable), free", ["state"], registry=r)
        per = ["replica"]
        self.replica_gauges = [Gauge(f"tp_lora_replica_{name}", f"{doc}, per data-parallel replica", per, registry=r)
                               for name, doc in (("queue_length", "Requests waiting for admission"),
                                                 ("running", "Sequences in the running batch"),
                                                 ("slot_hit_rate", "Admissions that found their adapter in a slot"),
                                                 ("adapter_reads", "Adapter reads from disk into host memory"),
                                                 ("adapter_loads", "Adapter copies into device slots"))]
        self._gauges: dict[int, tuple] = {}  # replica -> its last gauges
        self._residency: dict[int, tuple] = {}  # replica -> its last (slots, host)
        self._steps: dict[int, tuple] = {}  # replica -> its last step stats
        self.label = AdapterLabels()
        by = ["adapter"]
        self.adapter_requests = Counter("tp_lora_adapter_requests", f"Finished requests per adapter ({BASE_LABEL!r}: "
                                        f"none; past {MAX_ADAPTER_LABELS} adapters: {OTHER_LABEL!r})", by, registry=r)
        self.adapter_prompt_tokens = Counter("tp_lora_adapter_prompt_tokens", "Prompt tokens of finished requests per "
                                             "adapter", by, registry=r)
        self.adapter_generation_tokens = Counter("tp_lora_adapter_generation_tokens", "Generated tokens of finished "
                                                 "requests per adapter", by, registry=r)
        self.adapter_ttft = Histogram("tp_lora_adapter_time_to_first_token_seconds", "Arrival to first token per "
                                      "adapter", by, buckets=LATENCY_BUCKETS, registry=r)
        self.resident = Gauge("tp_lora_adapter_resident", "Adapters held per tier (device: in a slot; host: in host "
                              "memory), per adapter label (1, or the count under 'other')", ["adapter", "tier"],
                              registry=r)
        self.slots = Gauge("tp_lora_adapter_slots", "Device adapter slots holding an adapter (used) or none (free)",
                           ["state"], registry=r)
        self.host_adapters = Gauge("tp_lora_adapters_in_host_memory", "Adapters held in host memory", registry=r)
        self._resident: set[tuple[str, str]] = set()
        # tp_lora_engine_steps, ..._graph_steps, ..._decode_steps, ..._graph_seconds, ...: the engine's StepStats
        self.steps = [Gauge(f"tp_lora_engine_{f}", f"The engine's StepStats.{f} since start (its steps, those "
                            f"replayed from CUDA graphs, the decode-only ones, and their wall seconds)", registry=r)
                      for f in STEP_FIELDS]

    def set_gauges(self, replica: int, values: tuple) -> None:
        """A replica's engine values, as its loop sent them (tp_lora.server.channel's "gauges": Gauges' fields:
        waiting, running, slot hit rate, adapter reads, adapter loads, KV blocks used / cached / free)."""
        self._gauges[replica] = tuple(values)
        for gauge, value in zip(self.replica_gauges, values[:5]):
            gauge.labels(str(replica)).set(value)
        every = list(self._gauges.values())
        total = [sum(v[i] for v in every) for i in range(len(values))]
        waiting, running, _, reads, loads, kv_used, kv_cached, kv_free = total
        self.waiting.set(waiting)
        self.running.set(running)
        self.slot_hit_rate.set(sum(v[2] for v in every) / len(every))
        self.adapter_reads.set(reads)
        self.adapter_loads.set(loads)
        for state, n in (("used", kv_used), ("cached", kv_cached), ("free", kv_free)):
            self.kv_blocks.labels(state).set(n)

    def set_residency(self, replica: int, slots: tuple, host: tuple) -> None:
        """Which adapters a replica holds in its device slots (slot order, None for a free slot) and in host memory
        (the channel's "residency"); the series count over the replicas."""
        self._residency[replica] = (slots, host)
        counts: dict[tuple[str, str], int] = {}
        used = free = hosted = 0
        for slots, host in self._residency.values():
            for tier, names in (("device", [n for n in slots if n is not None]), ("host", host)):
                for name in names:
                    key = (self.label(name), tier)
                    counts[key] = counts.get(key, 0) + 1
            n = sum(x is not None for x in slots)
            used, free, hosted = used + n, free + len(slots) - n, hosted + len(host)
        for key in self._resident - set(counts):
            self.resident.remove(*key)
        for key, n in counts.items():
            self.resident.labels(*key).set(n)
        self._resident = set(counts)
        self.slots.labels("used").set(used)
        self.slots.labels("free").set(free)
        self.host_adapters.set(hosted)

    def keep_adapters(self, loaded) -> None:
        """The adapters now loaded: the per-adapter series of any other (unloaded) adapter go, its label freed."""
        gone = self.label.keep(loaded)
        if not gone:
            return
        for name in gone:
            for metric in (self.adapter_requests, self.adapter_prompt_tokens, self.adapter_generation_tokens,
                           self.adapter_ttft):
                metric.remove(name)  # a no-op where it has no series
        for key in [k for k in self._resident if k[0] in gone]:
            self.resident.remove(*key)
            self._resident.discard(key)

    def set_steps(self, replica: int, values: tuple) -> None:
        """A replica's engine step stats, as its loop sent them (the channel's "steps", named by STEP_FIELDS);
        the gauges hold their sums over the replicas."""
        self._steps[replica] = tuple(values)
        for i, gauge in enumerate(self.steps):
            gauge.set(sum(v[i] for v in self._steps.values()))

    def ended(self, res: Result, status: str) -> None:
        self.requests.labels(status).inc()
        if res.error is not None:
            return
        m, label = res.metrics, self.label(res.request.adapter)
        self.prompt_tokens.inc(len(res.request.prompt_token_ids))
        self.generation_tokens.inc(len(res.output_token_ids))
        self.adapter_requests.labels(label).inc()
        self.adapter_prompt_tokens.labels(label).inc(len(res.request.prompt_token_ids))
        self.adapter_generation_tokens.labels(label).inc(len(res.output_token_ids))
        if "first_token" in m and "arrival" in m:
            self.ttft.observe(m["first_token"] - m["arrival"])
            self.adapter_ttft.labels(label).observe(m["first_token"] - m["arrival"])
        if len(res.output_token_ids) > 1 and "finished" in m:
            self.tpot.observe((m["finished"] - m["first_token"]) / (len(res.output_token_ids) - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)
