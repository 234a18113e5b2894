"""Errors that cross module boundaries (a request the engine refuses, a checkpoint that cannot load)."""


class RequestError(ValueError):
    """A request that cannot be served; `field` names the offending field (HTTP 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(RuntimeError):
    """A checkpoint directory is missing a file or holds a corrupt one; the message names the file."""


class AnotherFamilysCheckpoint(ModelLoadError):
    """A checkpoint of another model family than the one loading it; `families` names the family (or the families,
    when the checkpoint fits several) it is of. The command line adds the recipes of that family to the fix."""

    def __init__(self, what: str, families: list[str]):
        super().__init__(f"{what}: pass --diffusion-model-family {' or '.join(families)}")
        self.what = what
        self.families = list(families)

    def __reduce__(self):  # crosses process boundaries (engine processes, Ray actors) with its fields
        return type(self), (self.what, self.families)


class EngineUnavailable(RuntimeError):
    """The engine failed or could not be reached; the request may be retried elsewhere."""


class RewardUnavailable(RuntimeError):
    """A reward server that did not answer after every retry."""


class WeightsMismatch(ModelLoadError):
    """Weights whose names or shapes are not those of the module they are loaded into (another model's)."""
