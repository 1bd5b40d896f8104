"""The trace format shared by the simulator (``planning/``), replay and the benchmarks (``bench/``).

One JSON object per line in the Mooncake format: ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` (one id per block of prompt tokens). ``traces.format`` reads,
validates and writes it; neither ``planning`` nor ``bench`` owns it, so neither imports the other
for it.
"""
