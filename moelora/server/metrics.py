"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class ServerMetrics:
    def __init__(self, stats) -> None:
        """stats: a callable returning the engine's current counters (AsyncEngine.stats)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moelora_requests", "Finished requests by status and adapter", ["status", "adapter"], registry=r)
        self.prompt_tokens = Counter("moelora_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("moelora_generation_tokens", "Tokens generated", registry=r)
        self.batch_size = Histogram("moelora_batch_size", "Requests sampled per engine step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.ttft = Histogram("moelora_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.tpot = Histogram("moelora_time_per_output_token_seconds", "Time per output token after the first",
                              registry=r, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        gauges = {
            "running": "Requests running", "waiting": "Requests waiting",
            "kv_blocks_total": "KV cache blocks", "kv_blocks_free": "KV cache blocks free",
            "lora_slots_total": "LoRA slots (max_loras)", "lora_slots_used": "LoRA slots holding an adapter",
            "lora_slots_in_use": "LoRA slots whose adapter running requests use",
            "adapters_loaded": "Adapters registered",
        }
        for key, doc in gauges.items():
            Gauge(f"moelora_{key}", doc, registry=r).set_function(lambda k=key: stats()[k])

    def render(self) -> bytes:
        return generate_latest(self.registry)
