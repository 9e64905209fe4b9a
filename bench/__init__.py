"""epgen's measurement tools, beside the runtime a model imports: they import ``runtime``; ``runtime`` never
imports them.

- ``python -m bench``: the sweep (``bench.sweep``: dispatch / combine vs NCCL all_to_all_single, graph and eager)
  and its layer modes (``--layer-loop``, ``--layer``, ``--ceiling``: ``bench.layer``), the floor
  (``bench.floor``) and kernels inside graph replays (``bench.profile_graph``); the command line is
  ``bench.cli``. What they share: the points' configs and inputs (``bench.inputs``), the rows and bytes they
  move (``bench.accounting``), the identity gate (``bench.gate``), the timing loops (``bench.measure``), the
  records' metadata and JSON lines (``bench.records``), the tables (``bench.tables``).
- ``python -m bench.tune``: the launch-geometry tuner (writes the user tuning file the runtime reads, or the
  checkout's specs/tuning.toml).
"""

__epgen__ = "bench"  # epgen's own (generator.foreign checks it)
