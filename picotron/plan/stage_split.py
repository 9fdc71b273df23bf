"""Which blocks each virtual stage of a pipeline runs, as the time model reads them: its
number of layers, and whether it holds the embedding and the head (with the loss).

    stage_split(config, profile) -> [(layers, embedding, head)] of the S = pp x v stages

This project's split (picotron/pipeline_parallel/stage.py) gives each stage L // S layers (the
first L % S one more), the embedding to the first and the head to the last. A profile whose
trainer splits by compute (the trait pp_split = "compute_cost": nanotron's build_model) walks
the blocks in order (embedding, the L layers, the head) with each block's cost, a layer
4 C^2 + 3 C I and the head V C (FLOPs a token, up to a constant), and moves to the next rank
after the block whose running cost passes that rank's share, k/pp of the total: the first
rank may take a layer more, and the head, worth a few layers, may leave the last ranks
empty. An empty stage forwards nothing but still costs its rank the micro-batch's host time.
"""
from picotron.pipeline_parallel.stage import stage_layers


def stage_split(config, profile) -> list:
    m, d = config.model, config.distributed
    stages = d.pp_size * (d.pp_virtual_stages if d.pp_engine == "interleaved"
                          and d.pp_size > 1 else 1)
    if profile.traits.get("pp_split") != "compute_cost" or stages != d.pp_size:
        layers = stage_layers(m.num_hidden_layers, stages)
        return [(len(held), s == 0, s == stages - 1) for s, held in enumerate(layers)]
    C, I = m.hidden_size, m.intermediate_size
    layer, head = 4 * C * C + 3 * C * I, m.vocab_size * C
    costs = [("embedding", 0)] + [("layer", layer)] * m.num_hidden_layers + [("head", head)]
    total = layer * m.num_hidden_layers + head
    split = [[0, False, False] for _ in range(stages)]
    rank, running = 0, 0
    for kind, cost in costs:
        running += cost
        if kind == "layer":
            split[rank][0] += 1
        else:
            split[rank][1 if kind == "embedding" else 2] = True
        if running > total * (rank + 1) / stages and rank < stages - 1:
            rank += 1
    return [tuple(s) for s in split]
