"""The errors a user's input can raise, at the bottom of the import graph.

`ConfigError` is raised by the config's checks (the `picotron.config` package re-exports it,
the name the entry points catch) and by the `--set` overrides (picotron/config/overrides.py),
which config/config.py imports.

`DataError` is raised by the data sources (picotron/data/windows.py), the Hugging Face dataset
loader (picotron/data/tokenized.py) and the tokenizers (picotron/data/tokenizer.py).
data/windows.py imports the other two, so the class lives here, where all three can import it
without importing each other; `picotron.data.windows` re-exports it, the name the entry points
catch."""


class DataError(ValueError):
    """The dataset section names data that cannot be loaded."""


class SharedDataError(DataError):
    """A DataError that every rank raises alike: rank 0 met it preparing the data and sent
    its message to the others (picotron/data/tokenized.py), so it is said once, not once per
    rank."""


class ConfigError(ValueError):
    """A config that cannot run. The message names every problem and its fix."""


class RunStopped(RuntimeError):
    """A run that stops itself rather than go on producing nothing (every step skipped for
    a non-finite gradient). The message says what happened and what to change."""
