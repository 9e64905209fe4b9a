"""Error classes of the epgen runtime (each also derives from the matching builtin)."""


class EpgenError(Exception):
    """Base of every error the epgen runtime raises on purpose."""


class ConfigError(EpgenError, ValueError):
    """An EpDispatchCombineConfig (or the process group it meets) is invalid or not built yet."""


class InputError(EpgenError, ValueError):
    """A dispatch/combine argument is invalid; the op stays usable."""


class ClosedError(EpgenError, RuntimeError):
    """The op was closed."""


class VariantMissError(EpgenError, LookupError):
    """No built kernel variant matches the request."""
