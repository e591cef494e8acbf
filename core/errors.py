"""Errors users see. Each names the option, file or plugin and what was expected."""


class LmplugError(Exception):
    """Base of every error lmplug raises on purpose."""


class ConfigError(LmplugError, ValueError):
    """An invalid config value (raised at load time, never mid-generation)."""


class PluginError(LmplugError):
    """A plugin could not be loaded, or two plugins clash."""


class ModelLoadError(LmplugError):
    """A checkpoint, GGUF or tokenizer file that cannot be used."""
