"""Micro-benchmarks, each next to its reference in the same run: the engine, the SSD tier,
the network fronts (native, NVMe/TCP, NIXL) and the codecs."""
