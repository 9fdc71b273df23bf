"""The wait nanotron's runs show on each pipeline receive when ZeRO-0 runs under torch DDP.

nanotron wraps a model in DistributedDataParallel only where dp > 1 and not (fp32 gradient
accumulation and ZeRO > 0): its ZeRO-0 runs with dp > 1; ZeRO-1 (and any dp 1) runs bare and
all-reduces its fp32 buffer by hand after the pipeline. In the Playbook's runs, a ZeRO-0
pipeline with dp > 1 whose sends cross nodes and that runs 16 or more micro-batches a step
lost the stall's wait (stall_s, about 0.5 s) on each receive: 8B on 2 to 16 nodes, 26 of the
32 that ran, 0.47-0.57 s a micro-batch at pp 2 (two end ranks, one receive each a
micro-batch) and 1.03-1.31 s at pp >= 4 (a middle rank receives twice: activations forward,
gradients backward); every such 1B run crashed (28). With 8 or fewer micro-batches (19 runs)
or inside one node (4) they ran as predicted. The cause is not in nanotron's source: under
DDP each micro-batch but the last runs DDP's forward under no_sync, no communication. Trait
`ddp_recv_stall` (the least micro-batches a step that stall; absent or 0: off): each stage's
forward that receives (all but the first) and backward that receives (all but the last) add
stall_s."""


def stalls_by_micro_batches(config, profile) -> bool:
    """Whether the step has the micro-batches the trait names (its grad_acc, which a predict
    cache's pipeline inputs key on through this)."""
    least = profile.traits.get("ddp_recv_stall", 0)
    return bool(least) and config.training.gradient_accumulation_steps >= least


def ddp_recv_stall_s(config, profile, sends_cross_nodes: bool) -> float:
    """Seconds a receiving stage's forward or backward waits; 0 where the trait is off, the
    pipeline's sends stay inside a node (or there is no pipeline), the trainer runs without
    DDP (ZeRO > 0 or dp 1), or the step has fewer micro-batches than the trait's."""
    d = config.distributed
    if not stalls_by_micro_batches(config, profile) or d.pp_size == 1 or not sends_cross_nodes:
        return 0.0
    if d.dp_size == 1 or d.zero_stage > 0:
        return 0.0
    return profile["stall_s"]
