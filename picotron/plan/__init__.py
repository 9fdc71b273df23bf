"""The plan wing: know before you run. What a config needs per rank, in memory, before anything
is allocated; nothing here is needed to train, except the memory check at set-up. It reads the
config and the grid; run/, train.py and create_config.py may import it.

Reading order (each file needs only the ones before it):
    memory_activations.py  what each layer keeps for backward, path by path, with its formula
    memory_state.py        the weights, gradients and AdamW state of a rank's parameters
    memory_advice.py       the changes that lower a config's memory, for the plan to name
    memory_plan.py         the memory a config needs per rank, the refusal of one that cannot
                           fit (`python -m picotron.plan.memory_plan CONFIG`), and what a run
                           that ran out anyway says
    grid_figure.py         the grid as a picture: every rank's coordinates and every group
                           (`python -m picotron.plan.grid_figure --dp 4 --tp 2 --pp 2 --out F`)
"""
