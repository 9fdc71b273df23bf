"""Build a model the way train.py does, with the speed plug-ins the test asks for."""
import torch

from picotron.attention import sdpa_attention
from picotron.config import Config, DistributedConfig, ModelConfig, TrainingConfig
from picotron.loss import causal_lm_loss
from picotron.model import Decoder, materialize
from picotron.speed import apply_speed


def build_with_speed(model_kwargs, kernels="torch", checkpointing="none", layers=None,
                     fused_loss="none", chunk_tokens=0, device="cpu", dtype=torch.float32,
                     seed=7):
    """(model, loss_fn): the textbook model drawn from `seed`, then `apply_speed` with these
    options, exactly as train.py applies them after the build."""
    config = Config(model=ModelConfig(**model_kwargs, kernels=kernels),
                    training=TrainingConfig(activation_checkpointing=checkpointing,
                                            activation_checkpointing_layers=layers,
                                            fused_loss=fused_loss,
                                            loss_chunk_tokens=chunk_tokens,
                                            # these options only: at 360M's widths "auto"
                                            # would add FP8 (it counts on graphs on a GPU)
                                            cuda_graphs=False, fp8="none"),
                    distributed=DistributedConfig(use_cpu=device == "cpu"))
    with torch.device("meta"):
        model = Decoder(config.model, sdpa_attention)
    model = materialize(model, seed, device, dtype)
    return apply_speed(model, causal_lm_loss, config)
