"""Error classes of the epgen runtime (each also derives from the matching builtin)."""


class EpgenError(Exception):
    """Base of every error the epgen runtime raises on purpose."""


class ConfigError(EpgenError, ValueError):
    """An EpDispatchCombineConfig (or the process group it meets) is invalid or not built yet."""


class InputError(EpgenError, ValueError):
    """A dispatch/combine argument is invalid; the op stays usable."""


class InputWarning(UserWarning):
    """Invalid input the kernels survived (dropped and counted) and found after the call that passed it:
    an eager call warns where raising on one rank would leave its peers waiting; ``op.check()`` raises
    the matching InputError."""


class ClosedError(EpgenError, RuntimeError):
    """The op was closed."""


class CapacityError(EpgenError, RuntimeError):
    """``strict_capacity=True``: a dispatch dropped received rows past ``max_total_recv_tokens``.

    ``dropped``: rows this rank dropped; ``capacity``: its receive capacity (max_recv_tokens).
    Raised eagerly only (inside CUDA graph capture nothing can raise: read ``op.dropped_count()``
    after replays), on every rank that dropped rows; the others return normally.
    """

    def __init__(self, message: str, *, dropped: int | None = None, capacity: int | None = None):
        self.dropped, self.capacity = dropped, capacity
        super().__init__(message)

    def __reduce__(self):
        return (_rebuild_capacity, (str(self), self.dropped, self.capacity))


def _rebuild_capacity(message, dropped, capacity) -> "CapacityError":
    return CapacityError(message, dropped=dropped, capacity=capacity)


class LaunchError(EpgenError, TypeError):
    """A kernel launch whose arguments do not match the family's declaration (specs/kernels.toml [args.NAME]):
    missing, unknown or mistyped, found before anything reaches the GPU."""


class VariantMissError(EpgenError, LookupError):
    """No built kernel variant matches the request."""


class EpTimeoutError(EpgenError, RuntimeError):
    """A device-side wait (barrier signal, counter) ran past ``config.timeout_s``.

    ``rank``: the rank whose kernel gave up; ``peer``: the rank it was waiting for (-1: its own
    blocks; None: unknown); ``phase``: the wait that expired (e.g. "combine entry barrier"). Raised by
    the native backend at the next call after the kernel recorded it, or by ``op.check()``.
    After it, ``op.reset()`` (collective) makes the op usable again if every rank is alive.
    """

    def __init__(self, message: str | None = None, *, rank: int | None = None, peer: int | None = None,
                 phase: str | None = None):
        self.rank, self.peer, self.phase = rank, peer, phase
        if message is None:
            who = f"rank {rank}" if rank is not None else "a rank"
            whom = "" if peer is None else f" for rank {peer}" if peer >= 0 else " for its own blocks"
            where = f" in {phase}" if phase else ""
            message = f"{who} timed out waiting{whom}{where}"
        super().__init__(message)

    def __reduce__(self):  # keep the keyword attributes through pickling (multiprocessing, all_gather_object)
        return (_rebuild_timeout, (str(self), self.rank, self.peer, self.phase))


def _rebuild_timeout(message, rank, peer, phase) -> EpTimeoutError:
    return EpTimeoutError(message, rank=rank, peer=peer, phase=phase)
