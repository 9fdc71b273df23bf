"""How far above its best does a healthy run's loss go, and when does the divergence rule
(picotron/run/divergence.py) stop a run that diverges? Tiny CPU runs on the embedded corpus,
one per learning rate, 200 steps each (about 10 s apiece on 2 cores):

    python bench/divergence_rule.py 3e-4 1e-3 3e-3 1e-2 3e-2 1e-1 3e-1 1

For each: the largest loss / running best, the longest stretch above 3x the best, the largest
mean of 20 steps / best, and the step the default rule (mean of 20 > 3x best) fires at."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import create_config  # noqa: E402

WINDOW, FACTOR = 20, 3.0


def losses_at(lr: str, out_dir: str) -> list:
    path = create_config.main([
        "--out_dir", out_dir, "--exp_name", f"lr{lr}", "--use_cpu", "--dataset_name", "embedded",
        "--seq_len", "64", "--mbs", "4", "--num_hidden_layers", "2", "--total_train_steps", "200",
        "--set", f"training.learning_rate={lr}", "--set", "training.warmup_steps=20",
        "--set", "checkpoint.save_final=false", "--set", "training.max_skipped_steps=0",
        "--set", "training.divergence_factor=0"])      # measured, not stopped
    subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", path],
                   cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                   check=True)
    with open(os.path.join(os.path.dirname(path), "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def main(rates: list) -> None:
    with tempfile.TemporaryDirectory() as out_dir:
        for lr in rates:
            losses = losses_at(lr, out_dir)
            best, peak, above, longest, peak_mean, fires = float("inf"), 0, 0, 0, 0, None
            for i, loss in enumerate(losses):
                best = min(best, loss)
                peak = max(peak, loss / best)
                above = above + 1 if loss > FACTOR * best else 0
                longest = max(longest, above)
                if i + 1 >= WINDOW:
                    mean = sum(losses[i + 1 - WINDOW:i + 1]) / WINDOW
                    peak_mean = max(peak_mean, mean / best)
                    fires = fires or (i + 1 if mean > FACTOR * best else None)
            print(f"lr {lr}: loss {losses[0]:.3f} -> {losses[-1]:.3f} (best {best:.3f}); "
                  f"max loss/best {peak:.2f}; longest run above {FACTOR:g}x best {longest}; "
                  f"max mean{WINDOW}/best {peak_mean:.2f}; the rule fires at step {fires}",
                  flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("rates", nargs="*", metavar="LR",
                        default=["3e-4", "1e-3", "3e-3", "1e-2", "3e-2", "1e-1", "3e-1", "1"],
                        help="learning rates, one run each (default: 3e-4 to 1)")
    main(parser.parse_args().rates)
