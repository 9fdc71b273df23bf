"""Export a checkpoint to a Hugging Face model directory.

    python export_hf.py --checkpoint tmp/NAME/checkpoints/step_000100 --out tmp/NAME/hf

The directory then loads with `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained`. `--checkpoint` may also be a checkpoints folder (its latest
complete checkpoint is used). PaLM-style models are refused: no Llama computes them.
"""
import argparse
import sys

from picotron.checkpoint import CheckpointError, resolve_checkpoint
from picotron.data import DataError
from picotron.hf_io import export_hf


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a step_* directory or a checkpoints dir")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", help="tokenizer id or path to ship instead of the run's")
    args = p.parse_args(argv)
    try:
        path = resolve_checkpoint("latest", args.checkpoint, ".") or args.checkpoint
        print(export_hf(path, args.out, args.tokenizer))
    except (CheckpointError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
