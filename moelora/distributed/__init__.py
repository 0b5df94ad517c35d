"""Tensor and expert parallelism over torch.distributed: process groups (`parallel_state`) and the in-place
sharding of a built model (`sharding`)."""

from moelora.distributed.parallel_state import (LaunchEnv, ParallelState, all_reduce_, check_launch, free_port,
                                                init_parallel, torchrun_env)
from moelora.distributed.sharding import kv_cache_config, shard_model

__all__ = ["LaunchEnv", "ParallelState", "all_reduce_", "check_launch", "free_port", "init_parallel", "kv_cache_config",
           "shard_model", "torchrun_env"]
