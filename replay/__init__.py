"""What a cache would have done on given traffic: traces, replays and the optimum to compare with.

- ``trace``: Mooncake request traces, read (every line checked) and written;
- ``workload``: a seeded chat workload in the same shape, for a replay without a trace file;
- ``cache``: a trace through one cache's index with any eviction policy, and Belady's offline optimum;
- ``stack``: a trace through a real tier stack, bytes and all, every hit checked bit-exact;
- ``sizing``: what a replay's hits are worth: prompt tokens not recomputed per second of trace, and the
  prefill time they save against the time loading them costs.

``kvtier replay`` (kvtier/replay_cli.py) drives them from the command line.
"""
