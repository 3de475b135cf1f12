"""The one exception type for bad user input."""


class ConfigError(ValueError):
    """A setting is wrong; the message is one line that names the setting and the fix."""
