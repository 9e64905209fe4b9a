"""The argument block of the EP kernels: one struct of 64-bit fields, passed by value.

Rendered into the C++ struct by templates/kernels/ep_common.j2 and mirrored as a ctypes structure
by the runtime, both from this one list, so the two can never drift apart.
"""

EP_ARGS = (
    # pointers (device addresses; 0 = absent)
    "x", "weights", "scales", "indices", "slots", "out", "out_weights", "expert_out", "expert_weights",
    "state", "total_recv", "peer_bases", "error_word", "replay_total",
    # byte offsets inside every rank's symmetric workspace
    "off_signal", "off_counter", "off_recv_x", "off_recv_w", "off_recv_idx", "off_recv_src",
    "off_comb_x", "off_comb_w", "off_recv_scales", "off_scat_x", "off_scat_s", "off_scat_w",
    # sizes and flags
    "num_tokens", "row_bytes", "hidden", "wire_row_bytes", "scale_row_bytes", "k", "experts_per_rank",
    "num_experts", "rank", "world", "max_recv", "max_tokens", "expert_rows", "has_weights",
    "timeout_ns", "replay", "block_rows",
    # low-latency protocol (dispatch_ll / combine_ll): its workspace regions and sizes
    "off_ll_cnt", "off_ll_x", "off_ll_c", "off_ll_map", "ll_tokens", "ll_row_bytes", "ll_cell_bytes",
)

# int32 words of the host-mapped error word: [0] set to 1 once the details below are complete,
# [1] rank, [2] peer waited for (-1: this rank's own blocks), [3] phase, [4] claim counter;
# expert ids >= num_experts seen by dispatch: [5] count, [6] the first one, [7] set to 1 once [6] is written
ERROR_WORDS = 8
PHASES = {1: "dispatch entry barrier", 2: "dispatch arrival wait", 3: "combine entry barrier",
          4: "combine staging barrier", 5: "low-latency dispatch count wait", 6: "low-latency dispatch row wait",
          7: "low-latency combine cell wait"}

# int32 words of each rank's local state tensor
# (last: the kind of this op's last completed EP kernel, 1 dispatch / 2 combine / 3 low-latency combine; the
# kernels decide their entry barriers from it on the device, so graph replays and eager calls mix safely;
# ll_dispatches / ll_combines: low-latency calls so far, their epochs and buffer parity)
STATE_WORDS = ("epoch", "done", "go", "bad_ids", "dropped", "dispatches", "last", "ll_dispatches", "ll_combines")
STATE_SIZE = 16

# The most tokens per rank a low-latency (dispatch_ll) call takes: every block keeps a 64-bit destination
# mask per token in shared memory (8 KiB).
LL_MAX_TOKENS = 1024
