"""The one exception type for mistakes a user can make and fix."""


class ConfigError(ValueError):
    """Bad input from the user: its message names the problem and the fix, in one line.

    Command-line entry points print it as ``error: <message>`` and exit with code 2.
    """
