"""The data error, alone at the bottom of the import graph.

`DataError` is raised by the data sources (picotron/data.py), the Hugging Face dataset loader
(picotron/tokenized_data.py) and the tokenizers (picotron/tokenizer.py). data.py imports the
other two, so the class lives here, where all three can import it without importing each
other; `picotron.data` re-exports it, the name the entry points catch."""


class DataError(ValueError):
    """The dataset section names data that cannot be loaded."""
