"""Sample text from a checkpoint.

    python generate.py --checkpoint tmp/NAME/checkpoints --prompt "def main(" \
        --max_new_tokens 200 --temperature 0.8 --top_k 50 --seed 0

`--checkpoint` is a step_* directory or a checkpoints folder (its latest checkpoint). The
tokenizer is the run's (byte-level, or the Hugging Face one it trained with). No KV cache:
each token re-runs the model over the whole text (see picotron/generate.py).
"""
import argparse
import sys

import torch

from picotron.checkpoint import CheckpointError, resolve_checkpoint
from picotron.data import DataError
from picotron.generate import load_for_inference, sample
from picotron.tokenizer import load_tokenizer, tokenizer_source


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompt", default="")
    p.add_argument("--max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top_k", type=int, default=0, help="keep the k likeliest tokens; 0: all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        path = resolve_checkpoint("latest", args.checkpoint, ".") or args.checkpoint
        model, config = load_for_inference(path, args.device)
        tokenizer = load_tokenizer(tokenizer_source(config))
    except (CheckpointError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    prompt = torch.tensor(tokenizer.encode(args.prompt), dtype=torch.long)
    if len(prompt) == 0:         # an empty prompt starts after an end of document
        prompt = torch.tensor([tokenizer.eos_token_id])
    out = sample(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                 tokenizer.eos_token_id, torch.Generator().manual_seed(args.seed),
                 config.model.max_position_embeddings)
    print(tokenizer.decode(out.tolist()))


if __name__ == "__main__":
    main()
