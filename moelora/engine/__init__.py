"""Engine: offline API, scheduler, paged KV cache, model runner, sampler."""
