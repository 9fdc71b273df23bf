"""The data wing: from text (the embedded corpus, a local file's bytes, a local or hub dataset)
to the numbered windows whose numbering makes a step's batch the same in every layout.

Reading order (each file needs only the ones before it):
    tokenizer.py      any Hugging Face tokenizer, or the built-in byte-level one
    local_files.py    a local dataset's files, and what their first rows say is wrong with them
    token_cache.py    the token cache every run on the machine shares, keyed by fingerprints,
                      written atomically, checked by sha256 before it is trusted
    tokenized.py      a dataset tokenized once, packed into one stream with EOS between
                      documents
    windows.py        numbered (seq_len + 1)-token windows: why the global batch of step k is
                      the same samples whatever the layout; raw byte ranges; the batches
    validation.py     the held-out loss (in bits per byte too when the tokens are bytes)
"""
