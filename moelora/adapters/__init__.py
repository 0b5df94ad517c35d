"""PEFT adapters: reading and validating the folders, the host registry, the GPU slot pool, layout conversion."""
