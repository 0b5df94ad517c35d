"""Compute kernels. Each op has a torch reference (the CPU path and the test oracle);
Triton kernels with the same signatures sit beside them. Imports nothing else from moelora."""
