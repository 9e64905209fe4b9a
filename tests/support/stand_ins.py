"""Stand-ins for the device: an op whose backend is the native backend's host side, over a fake queued stream,
so op.check()'s waits and error words are tested without a GPU."""

from __future__ import annotations

import torch


class _Queued:
    """Stand-in for the device: a dispatch kernel queued on stream 1111 notes expert id 77 in the
    host-mapped error words when that stream is synchronised."""

    def __init__(self, words, state=None, lag=False):
        self.words, self.synced = words, []
        self.late = []  # lag=True: the words the kernel wrote arrive only when the test delivers them
        test = self

        class Stream:
            def __init__(self, handle, device=None):
                self.handle = handle

            def synchronize(self):
                if self.handle == 1111 and 1111 not in test.synced:  # the kernel runs (once)
                    if state is not None:
                        state[3] += 1  # the device's bad-id count (abi.STATE_WORDS "bad_ids")
                    if lag:
                        test.late.append(lambda: words.__setitem__(slice(5, 8), [1, 77, 1]))
                    else:
                        words[5], words[6], words[7] = 1, 77, 1
                test.synced.append(self.handle)

        self.Stream = Stream


def stand_in_native_op(monkeypatch, lag=False):
    """An op whose backend is the native backend's host side over stand-ins for the device (lag: the
    host-mapped words arrive after the wait)."""
    from runtime import EpDispatchCombineOp
    from runtime import kernels
    from runtime.backends import native
    from tests.support.configs import make_config

    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)
    op = EpDispatchCombineOp(make_config(0, 1, num_experts_per_token=2))  # 2 experts: ids 0..1
    backend = object.__new__(native.NativeBackend)
    backend.config, backend.device, backend.id_check = op.config, torch.device("cuda", 0), "async"
    backend.error, backend._error_words = torch.zeros(8, dtype=torch.int32), [0] * 8
    backend._stream = 1111  # the stream of the op's last dispatch (the call is still queued there)
    backend.state, backend._bad_seen, backend._late_words = torch.zeros(16, dtype=torch.int32), 0, 0
    queued = _Queued(backend._error_words, backend.state, lag)
    monkeypatch.setattr(torch.cuda, "ExternalStream", queued.Stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(kernels, "current_raw_stream", lambda: 2222)
    real, op._backend = op._backend, backend
    return op, queued, real
