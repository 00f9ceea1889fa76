"""The one exception type for mistakes a user can make and fix."""


class ConfigError(ValueError):
    """Bad input from the user: its message names the problem and the fix, in one line.

    ``field`` is the config field that fixes it (``"model.n_heads"``), when one does. Library code
    speaks in fields and arguments only; the command-line layer
    (``jaxaccel.run.config.describe_error``) adds the flag that sets the field, prints ``error:
    <message>`` and exits with code 2.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field
