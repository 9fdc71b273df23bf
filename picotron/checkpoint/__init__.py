"""The checkpoint wing: save, find, verify and resume, exactly and in any layout; and the way
in and out of Hugging Face's format. Nothing in a checkpoint is a pickle, and a checkpoint is
trusted only as a whole.

Reading order (each file needs only the ones before it):
    shards.py        safetensors files any layout can read: each tensor a slice of a full one
    verify.py        is a checkpoint whole: state.json field by field, every file checksummed
    find.py          which checkpoint a run resumes from, decided by all ranks together
    changes.py       a resume that would change the run is refused, or recorded
    write.py         a save in two halves: the snapshot on the main thread, then only files
    async_save.py    those files written in the background, one save in flight
    checkpoint.py    save every N steps, keep the last K, resume exactly
    hf_cohere.py     the PaLM-style block as transformers' Cohere model
    export_dir.py    the folder an export may write, and what it keeps there
    hf_io.py         Hugging Face import (released weights) and export (back to transformers)
"""
