"""The engine's error types; the service maps each to one HTTP status and one gRPC code."""


class InvalidParameterError(ValueError):
    """A request is invalid (bad parameter, empty or over-long prompt); `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param, self.message = param, message


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting requests: shed load (HTTP 429 / RESOURCE_EXHAUSTED)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crash or shutdown); no request can be served."""


class ModelLoadError(RuntimeError):
    """A checkpoint folder cannot be served: unknown architecture, missing or mis-shaped weight,
    missing tokenizer."""
