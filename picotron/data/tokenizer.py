"""Tokenizers: any Hugging Face tokenizer (hub id or local path), or the built-in byte-level one.

`dataset.tokenizer` picks one: "byte" is byte-level (token id = byte value, vocab 256, byte 0
ends a document, as the embedded corpus does); a hub id or a directory loads that Hugging Face
tokenizer; None means "the model's": the tokenizer next to `checkpoint.init_from` or
`model.name` when that is a Hugging Face model, else byte-level for a preset of vocab <= 256.

The byte-level tokenizer can also be written as a Hugging Face tokenizer (a BPE with the 256
byte symbols and no merges), so an exported model loads with `AutoTokenizer` and encodes text
to exactly the ids it was trained on.
"""
import os

from picotron.errors import DataError


class TokenizerError(DataError):
    """A tokenizer that cannot be loaded or does not fit the model."""


def not_unicode(name: str, text: str, error: UnicodeEncodeError) -> TokenizerError:
    """A text holding lone surrogates, which is what Python makes of bytes that are not UTF-8
    on a command line (a shell's $'\\xff'): no Unicode text, so no tokenizer of text takes it."""
    bad = text[error.start:error.end]
    try:                                    # the bytes the user typed, as b'\xff\xfe'
        shown = f"the bytes {bad.encode('utf-8', 'surrogateescape')!r}"
    except UnicodeEncodeError:              # made in Python, not read from bytes
        shown = f"the lone surrogate {bad!r}"
    return TokenizerError(f"the text to encode is not UTF-8: {shown} at character "
                          f"{error.start}; tokenizer '{name}' takes UTF-8 text only: give "
                          f"the text as UTF-8")


class ByteTokenizer:
    """UTF-8 bytes as token ids. EOS is byte 0, which plain text never contains."""
    eos_token_id = 0
    vocab_size = 256
    name = "byte"

    def encode(self, text: str) -> list:
        # Bytes of a command line that are not UTF-8 reach Python as the surrogates
        # U+DC80..U+DCFF (surrogateescape): turned back into those bytes, which are tokens here.
        try:
            return list(text.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError as e:      # another lone surrogate: no byte stands for it
            raise not_unicode(self.name, text, e) from None

    def batch_encode(self, texts) -> list:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) != self.eos_token_id).decode("utf-8",
                                                                                 "replace")


class HFTokenizer:
    """A thin wrapper so that byte-level and Hugging Face tokenizers answer the same calls."""

    def __init__(self, name: str, hf_tokenizer):
        self.name, self.tok = name, hf_tokenizer
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.vocab_size = len(hf_tokenizer)   # includes added tokens
        if self.eos_token_id is None:
            raise TokenizerError(f"tokenizer '{name}' has no EOS token, which goes between "
                                 f"documents; pick a tokenizer that defines eos_token")

    def encode(self, text: str) -> list:
        try:        # the tokenizers library refuses surrogates with a TypeError naming no text
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise not_unicode(self.name, text, e) from None
        # No BOS/EOS from the tokenizer: packing puts exactly one EOS after each document.
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def batch_encode(self, texts) -> list:
        return self.tok(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def fingerprint(self) -> str:
        """Changes whenever the vocabulary or the rules change (keys the token cache)."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        return backend.to_str() if backend is not None else repr(sorted(self.tok.get_vocab()))


def tokenizer_source(config, fix: str = "set dataset.tokenizer to"):
    """The name or path of the tokenizer this run uses, or "byte". `fix`: as in
    load_tokenizer."""
    if config.dataset.raw_bytes:
        return "byte"          # the data is bytes, whatever tokenizer the model's name has
    if config.dataset.tokenizer:
        return config.dataset.tokenizer
    from picotron.config.presets import presets
    for candidate in (config.checkpoint.init_from, config.model.name):
        if not candidate:
            continue
        preset = presets().get(candidate)
        if preset is None:                      # a local directory or a hub id
            return candidate
        if preset.get("hub_id"):                # a preset mirroring a hub model
            return preset["hub_id"]
    if config.model.vocab_size <= 256:
        return "byte"
    raise TokenizerError(f"model '{config.model.name}' has no tokenizer of its own; {fix} "
                         f"a Hugging Face tokenizer id or path, or 'byte'")


def check_fits(tokenizer, vocab_size: int) -> None:
    """A tokenizer with more ids than the model's embedding rows: its ids past the table
    would fail deep inside torch.embedding (generate.py, an export's first use)."""
    if tokenizer.vocab_size > vocab_size:
        raise TokenizerError(f"tokenizer '{tokenizer.name}' has {tokenizer.vocab_size} tokens, "
                             f"more than the model's {vocab_size}; give --tokenizer the one "
                             f"the run trained with")


def hub_or_local_tokenizer(source: str):
    """transformers' tokenizer at `source`: a path, else a hub id from the local cache or
    downloaded once the hub has answered for it (config.presets.cached_or_hub: one request
    that fails at once offline, where the download would retry each file with backoff)."""
    from transformers import AutoTokenizer
    if os.path.exists(source):
        return AutoTokenizer.from_pretrained(source)
    from picotron.config.presets import cached_or_hub
    return cached_or_hub(lambda **cache: AutoTokenizer.from_pretrained(source, **cache), source)


def load_tokenizer(source: str, fix: str = "set dataset.tokenizer to"):
    """ByteTokenizer for "byte", else the Hugging Face tokenizer at `source` (path or hub id).
    `fix`: how the user names the tokenizer, for the error's fix."""
    if source == "byte":
        return ByteTokenizer()
    try:
        return HFTokenizer(source, hub_or_local_tokenizer(source))
    except TokenizerError:
        raise
    except Exception as e:   # missing path, offline hub, not a tokenizer directory
        if source.startswith(("/", ".", "~")) and not os.path.exists(source):
            raise TokenizerError(f"no tokenizer at '{source}': nothing exists there (moved or "
                                 f"deleted?); {fix} a tokenizer id or directory, or 'byte'"
                                 ) from None
        where = "the local path" if os.path.exists(source) else "the Hugging Face hub id"
        raise TokenizerError(f"could not load a tokenizer from {where} '{source}' "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''});"
                             f" {fix} a tokenizer id or directory, or 'byte'"
                             ) from None


def byte_symbols() -> list:
    """The printable character that stands for each byte value in byte-level BPE vocabularies
    (GPT-2's convention): printable Latin-1 bytes stand for themselves, the other 68 bytes are
    given the code points 256, 257, ... in byte order. Index b -> symbol of byte b."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE,
                                                                                           256))
    symbols, extra = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def save_byte_tokenizer(out_dir: str) -> None:
    """Write ByteTokenizer as a Hugging Face tokenizer: BPE over the 256 byte symbols with no
    merges, so every byte is one token and its id is the byte value; EOS is byte 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    symbols = byte_symbols()
    tok = Tokenizer(models.BPE(vocab={s: b for b, s in enumerate(symbols)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=symbols[0]).save_pretrained(out_dir)


def is_byte_tokenizer(directory) -> bool:
    """True when `directory` holds the tokenizer save_byte_tokenizer writes (every byte its own
    token, id = byte value): a model exported by picotron from byte-level training, which
    then fine-tunes on byte-level data without dataset.tokenizer='byte'."""
    import json
    path = os.path.join(str(directory), "tokenizer.json")
    try:
        with open(path) as f:
            model = json.load(f)["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return (model.get("type") == "BPE" and not model.get("merges")
            and model.get("vocab") == {s: b for b, s in enumerate(byte_symbols())})

