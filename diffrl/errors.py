"""Errors that cross module boundaries (a request the engine refuses, a checkpoint that cannot load)."""


class RequestError(ValueError):
    """A request that cannot be served; `field` names the offending field (HTTP 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(RuntimeError):
    """A checkpoint directory is missing a file or holds a corrupt one; the message names the file."""


class WeightsMismatch(ModelLoadError):
    """Weights whose names or shapes are not those of the module they are loaded into (another model's)."""
