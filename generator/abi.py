"""Protocol constants the kernels and the runtime share: the error word, the state words, the low-latency
limit. (Every kernel's launch arguments are declared in specs/kernels.toml [args.NAME].)
"""

# int32 words of the host-mapped error word: [0] set to 1 once the details below are complete,
# [1] rank, [2] peer waited for (-1: this rank's own blocks), [3] phase, [4] claim counter;
# expert ids >= num_experts seen by dispatch: [5] count, [6] the first one, [7] set to 1 once [6] is written
ERROR_WORDS = 8
PHASES = {1: "dispatch entry barrier", 2: "dispatch arrival wait", 3: "combine entry barrier",
          4: "combine staging barrier", 5: "low-latency dispatch count wait", 6: "low-latency dispatch row wait",
          7: "low-latency combine cell wait", 8: "grouped layout grid barrier",
          9: "direct grouped dispatch count wait"}

# int32 words of each rank's local state tensor
# (last: the kind of this op's last completed EP kernel, 1 dispatch / 2 combine / 3 low-latency combine; the
# kernels decide their entry barriers from it on the device, so graph replays and eager calls mix safely;
# ll_dispatches / ll_combines: low-latency calls so far, their epochs and buffer parity)
# grid_arrive / grid_gen: the grid-wide barrier of a dispatch that places the grouped layout in its tail;
# grouped_end: the end of the last layout's groups (the rows the next one re-marks as padding)
STATE_WORDS = ("epoch", "done", "go", "bad_ids", "dropped", "dispatches", "last", "ll_dispatches", "ll_combines",
               "grid_arrive", "grid_gen", "grouped_end")
STATE_SIZE = 16

# The most tokens per rank a low-latency (dispatch_ll) call takes: every block keeps a 64-bit destination
# mask per token in shared memory (8 KiB).
LL_MAX_TOKENS = 1024
