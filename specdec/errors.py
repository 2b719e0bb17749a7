"""The one exception type the engine raises for bad input; the service maps it to a 4xx, the CLI to exit 2."""


class SpecDecError(ValueError):
    """A request or model pair that cannot be decoded. `field` names the offending parameter, if any."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
