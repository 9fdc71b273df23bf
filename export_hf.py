"""Export a checkpoint to a Hugging Face model directory.

    python export_hf.py --checkpoint tmp/NAME/checkpoints/step_000100 --out tmp/NAME/hf

The directory then loads with `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained`. `--checkpoint` may also be a checkpoints folder (its latest
complete checkpoint is used). A Llama-style model exports as LlamaForCausalLM, a PaLM-style
one (parallel_residual with layernorm) as CohereForCausalLM (picotron/checkpoint/hf_cohere.py).
`--out` may hold an earlier export, which is replaced; any other non-empty folder, such as a
downloaded model, is refused and left as it was (picotron/checkpoint/export_dir.py).
"""
import argparse
import os
import sys

from picotron.checkpoint.checkpoint import CheckpointError, checkpoint_to_read
from picotron.config import ConfigError
from picotron.config.overrides import parse_flags
from picotron.data.windows import DataError
from picotron.checkpoint.export_dir import ExportError, check_export_dir
from picotron.checkpoint.hf_io import export_hf


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=os.path.expanduser, required=True,
                   help="a step_* checkpoint directory, or a run's checkpoints folder (its "
                        "latest complete checkpoint), e.g. tmp/debug/checkpoints")
    p.add_argument("--out", type=os.path.expanduser, required=True,
                   help="the Hugging Face model directory to write (config.json, "
                        "model.safetensors, the tokenizer's files, picotron_export.json): new, "
                        "empty, or an earlier export (which it replaces), never a folder of "
                        "other files such as a downloaded model; e.g. tmp/debug-hf")
    p.add_argument("--tokenizer", type=os.path.expanduser,
                   help="a tokenizer (hub id or directory) to ship instead of the run's own "
                        "(default: the run's: byte-level, or the one it trained with)")
    return p


def main(argv=None):
    args = parse_flags(build_parser(), argv)
    try:
        check_export_dir(args.out)                       # before reading any weights
        path = checkpoint_to_read(args.checkpoint)       # verified: checksums, manifest
        print(export_hf(path, args.out, args.tokenizer))
    except (CheckpointError, ConfigError, DataError, ExportError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:         # a full disk while writing: the earlier export is whole
        print(f"error: writing the export to '{args.out}' failed ({type(e).__name__}: {e}); "
              f"any earlier export there is as it was: free the space (or fix the cause) and "
              f"run the export again", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
