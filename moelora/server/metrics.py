"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

GAUGES = {
    "running": "Requests running", "waiting": "Requests waiting",
    "kv_blocks_total": "KV cache blocks", "kv_blocks_free": "KV cache blocks free",
    "kv_blocks_free_min": "The fewest KV cache blocks free since the server started",
    "lora_slots_total": "LoRA slots (max_loras)", "lora_slots_used": "LoRA slots holding an adapter",
    "lora_slots_in_use": "LoRA slots whose adapter running requests use",
    "adapters_loaded": "Adapters registered",
    "prefix_cache_blocks": "KV blocks holding a cached prompt prefix (in use or evictable)",
}

COUNTERS = {
    "requests_cancelled": "Requests aborted before they finished (client disconnected, shutdown)",
    "requests_failed": "Requests ended by an error (an adapter whose files could not be read again, a failed step)",
    "preemptions": "Running requests preempted for KV blocks (recomputed later)",
    "adapter_loads": "Adapters loaded (API, start-up)",
    "adapter_reloads": "Adapters read again from their files after leaving host memory (--max-cpu-loras)",
    "adapter_load_failures": "Adapters that could not be read again (files gone, changed or outside --lora-root)",
    "adapter_unloads": "Adapters unloaded",
    "adapter_slot_loads": "Adapters written into a LoRA slot (swaps)",
    "adapter_slot_evictions": "Adapters evicted from a LoRA slot for another",
    "adapter_cpu_evictions": "Adapters dropped from host memory (--max-cpu-loras)",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache (first admissions)",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache (not computed again)",
    "prefix_cache_evictions": "Cached prefix blocks reused for other contents",
    "triton_kernel_builds": "Triton kernel variants built (compiled or read from disk) at first use since serving "
                            "began; each stalls its step. Growing in steady serving: shapes the warm-up missed",
}


class _EngineCounters:
    """Monotonic totals the engine keeps as plain ints, exposed as Prometheus counters when scraped."""

    def __init__(self, counters: Callable[[], dict[str, int]]) -> None:
        self.counters = counters

    def collect(self):
        values = self.counters()
        for key, doc in COUNTERS.items():
            c = CounterMetricFamily(f"moelora_{key}", doc)
            c.add_metric([], values.get(key, 0))
            yield c


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, int]], counters: Callable[[], dict[str, int]]) -> None:
        """stats: the engine's current gauges (AsyncEngine.stats); counters: its totals since start
        (AsyncEngine.counters)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moelora_requests", "Finished requests by status and adapter", ["status", "adapter"], registry=r)
        self.http_errors = Counter("moelora_http_errors", "Error responses by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("moelora_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("moelora_generation_tokens", "Tokens generated", registry=r)
        self.batch_size = Histogram("moelora_batch_size", "Requests sampled per engine step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.step = Histogram("moelora_step_duration_seconds", "Engine steps by kind: prefill (computes prompt "
                              "tokens, eager) or decode (one token a request, a CUDA graph where captured)", ["kind"],
                              registry=r, buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5))
        self.ttft = Histogram("moelora_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.tpot = Histogram("moelora_time_per_output_token_seconds", "Time per output token after the first",
                              registry=r, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        for key, doc in GAUGES.items():
            Gauge(f"moelora_{key}", doc, registry=r).set_function(lambda k=key: stats()[k])
        r.register(_EngineCounters(counters))

    def observe_step(self, updated: int, seconds: float, prefill: bool) -> None:
        """AsyncEngine.on_step: one engine step, `updated` requests given tokens in `seconds`."""
        if updated:
            self.batch_size.observe(updated)
        self.step.labels(kind="prefill" if prefill else "decode").observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
