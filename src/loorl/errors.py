"""The exception types whose message is all a user needs: one line, no traceback (`cli.console.run_cli`)."""


class ConfigError(ValueError):
    """A setting is wrong; the message is one line that names the setting and the fix."""


class ServersLost(RuntimeError):
    """Every rollout server stopped answering mid-run; the message is one line naming the last one."""
