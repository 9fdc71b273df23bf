"""The stage split: which layers each pipeline rank keeps, and the tied embedding across ends.

Layers are cut into S = pp * v consecutive virtual stages (v = pp_virtual_stages under the
interleaved schedule, else 1). The split is balanced: every virtual stage gets L // S layers
and, when S does not divide L, the first L % S stages get one more (allowed for afab and 1f1b
and printed at start-up; the interleaved schedule needs equal chunks). The embedding lives on
the first stage, the final norm and the head on the last.

Layers keep their global keys ("0".."L-1") in the model's ModuleDict, so every parameter keeps
the name it has in one process: initial values, checkpoints and tests do not depend on pp.
"""


def virtual_stages(config) -> int:
    d = config.distributed
    return d.pp_virtual_stages if d.pp_engine == "interleaved" else 1


def stage_layers(num_layers: int, num_stages: int) -> list:
    """layers[s]: the global layer indices of virtual stage s (balanced, the first L % S
    stages one layer longer)."""
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages: "
                         f"every stage needs at least one layer")
    base, extra = divmod(num_layers, num_stages)
    layers, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        layers.append(list(range(start, start + n)))
        start += n
    return layers


def rank_chunks(config, pp_rank: int) -> list:
    """chunks[c]: the layer keys of this rank's chunk c, i.e. of virtual stage c * pp + rank."""
    pp, v = config.distributed.pp_size, virtual_stages(config)
    layers = stage_layers(config.model.num_hidden_layers, pp * v)
    return [[str(i) for i in layers[c * pp + pp_rank]] for c in range(v)]


def describe_split(config) -> str:
    """One line stating every rank's layers and the expected bubble, e.g.
    'pipeline 1f1b: rank 0: 0-2 | rank 1: 3-5 | rank 2: 6-7; bubble 2/(4+2) = 33%'.

    The bubble is the idle fraction of a step, (pp - 1) / (m + pp - 1) for m micro-batches
    (GPipe and 1F1B alike); interleaving makes the fill and drain v times shorter:
    (pp - 1) / (v*m + pp - 1)."""
    pp, v = config.distributed.pp_size, virtual_stages(config)
    m = config.training.gradient_accumulation_steps

    def span(keys):
        return keys[0] if len(keys) == 1 else f"{keys[0]}-{keys[-1]}"
    ranks = [f"rank {r}: " + " + ".join(span(c) for c in rank_chunks(config, r))
             for r in range(pp)]
    bubble = (pp - 1) / (v * m + pp - 1)           # = ((pp-1)/v) / (m + (pp-1)/v)
    return (f"pipeline {config.distributed.pp_engine}: " + " | ".join(ranks) +
            f"; bubble {pp - 1}/({v * m}+{pp - 1}) = {100 * bubble:.0f}%")


def apply_pipeline_parallel(model, pgm, config):
    """Keep this rank's layers (and the embedding / norm / head if its stage has them).

    Called on the meta-device skeleton, before the weights are drawn. With tied embeddings and
    pp > 1, the first stage's embedding and the last stage's head cannot share one Parameter:
    the last stage keeps its own copy, drawn from the seed under the name
    "embed_tokens.weight" (`tied_name`), so both copies start equal. Each end then holds part
    of the gradient (embedding use, head use): both are marked with `grad_sum_group`, the
    manager's `pp_ends_group` of the two ends, and the gradient buckets sum them there before
    averaging over cp_dp, so both copies get the whole gradient and the same update. The copy
    is left out of the gradient norm (`grad_norm_skip`) and of checkpoints (`tied_name`)."""
    if pgm.pp_size == 1:
        return model
    keep = {key for chunk in rank_chunks(config, pgm.pp_rank) for key in chunk}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    tied = config.model.tie_word_embeddings
    if not pgm.pp_is_first_stage:
        model.embed_tokens = None
    elif tied:
        model.embed_tokens.weight.grad_sum_group = pgm.pp_ends_group
    if not pgm.pp_is_last_stage:
        model.norm, model.lm_head = None, None
    elif tied:
        head = model.lm_head.weight           # the tied Parameter, now the head's alone
        head.tied_name = "embed_tokens.weight"
        head.grad_norm_skip = True
        head.grad_sum_group = pgm.pp_ends_group
    return model
