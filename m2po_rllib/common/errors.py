"""`ConfigError`: a setting a user can fix, raised by `M2POConfig.validate()` and the jobs'
own checks (YAML files, search spaces, run directories). The CLI prints it as one line; any
other exception is a bug and keeps its traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad setting, with the fix in the message.

    `settings`: the names of the settings at fault (`policy_loss`, `lr`, `training.lr`, ...)
    as the message names them, so a caller (the lab) can say which of its keys to change
    without reading the message's text.
    """

    def __init__(self, message: str, settings: tuple[str, ...] | list[str] = ()):
        super().__init__(message)
        self.settings = tuple(settings)
