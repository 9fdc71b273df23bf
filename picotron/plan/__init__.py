"""The plan wing: know before you run. What a config needs per rank, in memory, before anything
is allocated, and how long its step will take on a given machine; nothing here is needed to
train, except the memory check at set-up. It reads the config and the grid; run/, train.py
and create_config.py may import it.

Reading order (each file needs only the ones before it):
    memory_activations.py  what each layer keeps for backward, path by path, with its formula
    memory_state.py        the weights, gradients and AdamW state of a rank's parameters
    memory_advice.py       the changes that lower a config's memory, for the plan to name
    memory_plan.py         the memory a config needs per rank, the refusal of one that cannot
                           fit (`python -m picotron.plan.memory_plan CONFIG`), and what a run
                           that ran out anyway says
    grid_figure.py         the grid as a picture: every rank's coordinates and every group
                           (`python -m picotron.plan.grid_figure --dp 4 --tp 2 --pp 2 --out F`)
    layouts.py             a layout as a table row (dp tp pp cp zero mbs grad_acc ...) and the
                           project's Config built from it, refused with the config's message
    hardware.py            hardware profiles as data (hardware/*.json), every number sourced
    traffic.py             the bytes the passes outside the GEMMs move, kernel by kernel
    compute_time.py        a layer's and a stage's compute: GEMMs by shape, attention, bytes
    comm_time.py           each collective's time from its size, algorithm and the links its
                           group crosses (inside a node or between nodes)
    pipeline_sim.py        the pipeline's timeline, simulated from the schedules' own orders
    stage_split.py         which blocks each pipeline stage runs: the engine's equal split, or
                           a profile's trainer's split by each block's compute
    nanotron_memory.py     nanotron's own memory of a layout, rank by rank, from its source
    trainer_memory.py      a profile's memory of a layout against its GPU: the plan's estimate
                           scaled to another trainer's runs, or that trainer's own count, with
                           the margin it must leave
    predict_cache.py       the pieces a search's predictions share, each kept under the knobs
                           it reads
    step_tail.py           what each pipeline rank does after its last backward: the gradients'
                           reduction, the tied embedding's sum, ZeRO's gather, the optimizer
    ddp_stall.py           the wait nanotron's runs show on each pipeline receive of a ZeRO-0
                           pipeline under torch DDP, a profile's trait
    step_time.py           one optimizer step's predicted time, throughput, MFU and memory
    judge.py               the config's verdict on one layout of a search, the config resolved
    share_work.py          a search's grids shared with a forked second process, where there
                           is a second core: the same result
    report.py              the search's table of the fastest layouts and its refusals, counted
                           by reason, each memory estimate as its range
    search.py              every layout of N GPUs the config accepts, scored and ranked
    score.py               a prediction for each row of a CSV of layouts
    auto_layout.py         create_config.py's --auto_layout: the search's fastest layout, the
                           knobs the user gave kept
    step_lanes.py          one layout's predicted step as bars, a lane per pipeline rank
    explain.py             those lanes as a picture, each rank's memory beside its lane
    __main__.py            `python -m picotron.plan search | score | explain`
"""
