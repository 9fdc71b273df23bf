"""Sample text from a checkpoint.

    python generate.py --checkpoint tmp/NAME/checkpoints --prompt "def main(" \\
        --max_new_tokens 200 --temperature 0.8 --top_k 50 --seed 0

`--checkpoint` is a step_* directory or a checkpoints folder (its latest checkpoint). The
tokenizer is the run's (byte-level, or the Hugging Face one it trained with). No KV cache:
each token re-runs the model over the whole text (see picotron/run/generate.py). A text longer than
the run's training.seq_length is warned of: the model never saw positions past it.
"""
import argparse
import os
import sys
import time

# OpenMP's threads sleep at a barrier instead of spinning: a spinning pool whose thread shares
# a core with another program waits for that thread's time slice at every operation
# (bench/NOTES.md, "CPU threads"). libgomp reads this once, when torch loads it. Yours is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from picotron.checkpoint.checkpoint import CheckpointError, checkpoint_to_read
from picotron.config import ConfigError
from picotron.config.overrides import parse_flags
from picotron.data.windows import DataError
from picotron.run.generate import load_for_inference, sample
from picotron.data.tokenizer import check_fits, load_tokenizer, tokenizer_source
from picotron.utils import set_cpu_threads


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=os.path.expanduser, required=True,
                   help="a step_* checkpoint directory, or a run's checkpoints folder (its "
                        "latest complete checkpoint), e.g. tmp/debug/checkpoints")
    p.add_argument("--prompt", default="",
                   help="text to continue (default: empty, which starts a new document)")
    p.add_argument("--max_new_tokens", type=int, default=100,
                   help="tokens to sample after the prompt; stops early at end of document "
                        "(default: 100)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="divides the logits before sampling: below 1 is more conservative, "
                        "0 always takes the likeliest token (greedy) (default: 1.0)")
    p.add_argument("--top_k", type=int, default=0,
                   help="sample among the k likeliest tokens only; 0: all (default: 0)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampling; the same seed gives the same text (default: 0)")
    p.add_argument("--tokenizer", type=os.path.expanduser,
                   help="a tokenizer (hub id, directory, or 'byte') instead of the run's own, "
                        "e.g. when the folder it trained with has moved")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model runs, e.g. cpu, cuda, cuda:1 (default: cuda when a "
                        "GPU is visible, else cpu)")
    return p


def warn_past_trained_windows(prompt_tokens: int, max_new_tokens: int, config) -> None:
    """The context is cropped at model.max_position_embeddings, what RoPE's tables hold, but
    the model only ever read training.seq_length tokens at once: past them its text may
    degrade, and nothing else would say why. The last new token is predicted from all the
    tokens before it, so the model reads at most prompt + max_new_tokens - 1."""
    trained, longest = config.training.seq_length, config.model.max_position_embeddings
    reads = min(prompt_tokens + max_new_tokens - 1, longest)
    if reads > trained:
        print(f"warning: the prompt ({prompt_tokens} tokens) and --max_new_tokens "
              f"{max_new_tokens} make the model read up to {reads} tokens, but it was trained "
              f"on {trained}-token windows (training.seq_length): positions past {trained} "
              f"were never trained, and the text there may degrade (the context is cropped "
              f"at model.max_position_embeddings={longest})", file=sys.stderr)


def main(argv=None):
    parser = build_parser()
    args = parse_flags(parser, argv)
    for name in ("max_new_tokens", "temperature", "top_k"):
        value = getattr(args, name)
        if not 0 <= value < float("inf"):          # NaN too
            parser.error(f"--{name} {value} must be a finite number >= 0 (see --help)")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a device; give cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):      # meta, mps, ...: no kernels or data here
        parser.error(f"--device {args.device}: generate.py runs on cpu or cuda (cuda:N) "
                     f"only; give one of them")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device} needs a CUDA GPU, and none is visible; give cpu")
    if args.device == "cpu":
        set_cpu_threads(1)     # one process: every core here (passive wait, above)
        # fp32 weights that training drove near zero can be denormal, which the CPU's
        # matmuls take a slow path for; read as 0 they change no sample visibly
        torch.set_flush_denormal(True)
    started = time.perf_counter()
    try:
        path = checkpoint_to_read(args.checkpoint)       # verified: checksums, manifest
        model, config = load_for_inference(path, args.device)
        fix = "give --tokenizer"         # a checkpoint's saved settings cannot be changed
        tokenizer = load_tokenizer(args.tokenizer or tokenizer_source(config, fix), fix)
        check_fits(tokenizer, config.model.vocab_size)
        prompt = torch.tensor(tokenizer.encode(args.prompt), dtype=torch.long)
    except (CheckpointError, ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if len(prompt) == 0:         # an empty prompt starts after an end of document
        prompt = torch.tensor([tokenizer.eos_token_id])
    warn_past_trained_windows(len(prompt), args.max_new_tokens, config)
    print(f"loaded {path} ({sum(p.numel() for p in model.parameters()):,} parameters) in "
          f"{time.perf_counter() - started:.1f}s; sampling {args.max_new_tokens} tokens on "
          f"{args.device}", file=sys.stderr)
    started = time.perf_counter()
    out = sample(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                 tokenizer.eos_token_id, torch.Generator().manual_seed(args.seed),
                 config.model.max_position_embeddings)
    new = len(out) - len(prompt)
    seconds = time.perf_counter() - started
    print(tokenizer.decode(out.tolist()))
    print(f"{new} tokens in {seconds:.1f}s ({new / max(seconds, 1e-9):.1f} tokens/s)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
