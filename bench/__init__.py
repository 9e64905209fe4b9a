"""epgen's measurement tools, beside the runtime a model imports: they import ``runtime``; ``runtime`` never
imports them.

- ``python -m bench``: the sweep (``bench.core``: dispatch / combine vs NCCL all_to_all_single, graph and eager)
  and its layer modes (``--layer-loop``, ``--layer``, ``--ceiling``: ``bench.layer``); the command line is
  ``bench.cli``.
- ``python -m bench.tune``: the launch-geometry tuner (writes the user tuning file the runtime reads, or the
  checkout's specs/tuning.toml).
"""

__epgen__ = "bench"  # epgen's own (generator.foreign checks it)
