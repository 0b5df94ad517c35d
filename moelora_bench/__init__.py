"""The benchmarks behind `moelora bench`: kernels, decode (with --ab over kernel configs), serve, report, plot."""
