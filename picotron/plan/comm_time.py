"""The time of each collective a layout runs, from its message size, its algorithm and the links
its group crosses: inside a node (NVLink) or between nodes (the NICs), so a group that spans
nodes is slower.

Where a group's ranks sit follows the grid: `rank_order` (the profile's trait, outermost axis
first; this project's is dp, pp, cp, tp: tp varies fastest, picotron/process_group_manager.py)
gives each axis a stride, the product of the sizes inside it; a group of `size` ranks `stride`
apart has g = gpus_per_node // stride of them in each node (at least 1, at most size) over
k = size / g nodes.

Algorithms (S bytes of the whole buffer, g ranks a node, k nodes, b_in / b_out the profile's
bus bandwidths inside and between nodes per GPU, l_in / l_out their step latencies, which
depend on whose collective it is: LATENCIES):
    all-reduce      hierarchical: a ring inside the node, then the node's shards across nodes:
                    2 (g-1)/g S / b_in + 2 (k-1)/k S / (g b_out)
                    + latency 2 (g-1) l_in + 2 (k-1) l_out (a ring across nodes too: NCCL's
                    choice for large messages, whose latency grows with the nodes it spans)
    all-gather, reduce-scatter   half of that: each byte crosses each link once
    all-to-all      each rank sends (size-1)/size of its S: the share for ranks of its node at
                    b_in, the rest at b_out
    send/recv       S / b + l, b of the link between the two ranks
"""
import math

BF16 = 2


def group_shape(axis_sizes: dict, axis: str, rank_order, gpus_per_node: int) -> tuple:
    """(size, ranks per node g, nodes k) of one `axis` group."""
    size = axis_sizes[axis]
    inner = rank_order[rank_order.index(axis) + 1:]
    stride = math.prod(axis_sizes[a] for a in inner)
    g = max(1, min(size, gpus_per_node // stride))
    return size, g, max(1, size // g)


def merged_shape(shapes) -> tuple:
    """(size, g, k) of a group that is the product of several axes' groups (cp x dp)."""
    size = math.prod(s for s, _, _ in shapes)
    g = math.prod(g for _, g, _ in shapes)
    return size, g, max(1, size // g)


# (inside a node, between nodes) latency of a ring step, by whose collective it is: a layer's
# (tensor parallelism's), the same on a rank of a pipeline whose sends cross nodes (the host
# waits on each step there), and the data-parallel reductions and gathers at the step's end
# (the network's own latency: no host waits on their steps one by one)
LATENCIES = {"layer": ("intra_latency_s", "inter_latency_s"),
             "pipelined": ("intra_latency_pp_s", "inter_latency_pp_s"),
             "data_parallel": ("intra_latency_s", "dp_latency_s")}


class Links:
    """A profile's links, for the collectives of one layout's groups; `pipelined` and
    `data_parallel` are the same links at those collectives' latencies (LATENCIES)."""

    def __init__(self, profile, role="layer"):
        self.b_in, self.b_out = profile["intra_bytes_per_s"], profile["inter_bytes_per_s"]
        self.l_in, self.l_out = (profile[key] for key in LATENCIES[role])
        if role == "layer":
            self.pipelined = Links(profile, "pipelined")
            self.data_parallel = Links(profile, "data_parallel")

    def all_reduce(self, nbytes, shape) -> float:
        size, g, k = shape
        if size == 1:
            return 0.0
        return 2 * self._half(nbytes, g, k)

    def all_gather(self, nbytes, shape) -> float:
        """Also a reduce-scatter: S is the whole (gathered) buffer."""
        size, g, k = shape
        return 0.0 if size == 1 else self._half(nbytes, g, k)

    def _half(self, nbytes, g, k) -> float:
        inside = (g - 1) / g * nbytes / self.b_in + (g - 1) * self.l_in
        across = (k - 1) / k * nbytes / (g * self.b_out) + (k - 1) * self.l_out
        return inside + (across if k > 1 else 0.0)

    def all_to_all(self, nbytes, shape) -> float:
        size, g, k = shape
        if size == 1:
            return 0.0
        near, far = (g - 1) / size, (size - g) / size
        return (nbytes * (near / self.b_in + far / self.b_out)
                + (g - 1) * self.l_in + (size - g) * self.l_out)

    def send(self, nbytes, across_nodes: bool) -> float:
        if across_nodes:
            return nbytes / self.b_out + self.l_out
        return nbytes / self.b_in + self.l_in


def layout_groups(config, profile, gpus_per_node: int) -> dict:
    """{axis: (size, g, k)} for tp, cp, pp, dp and the gradients' cp x dp group."""
    d = config.distributed
    sizes = {"dp": d.dp_size, "tp": d.tp_size, "pp": d.pp_size, "cp": d.cp_size}
    order = profile.traits.get("rank_order", ["dp", "pp", "cp", "tp"])
    shapes = {a: group_shape(sizes, a, order, gpus_per_node) for a in sizes}
    shapes["cp_dp"] = merged_shape([shapes["cp"], shapes["dp"]])
    return shapes


def tp_layer_s(config, links, shape, tokens: int) -> float:
    """One direction (forward, or backward) of one layer's tensor-parallel collectives for
    `tokens` tokens: two all-reduces of the (n, C) activation (attention's output, the
    MLP's), or under sequence parallelism two all-gathers and two reduce-scatters of it."""
    nbytes = tokens * config.model.hidden_size * BF16
    if config.distributed.sequence_parallel:
        return 4 * links.all_gather(nbytes, shape)
    return 2 * links.all_reduce(nbytes, shape)


def cp_layer_s(config, links, shape, tokens: int) -> tuple:
    """(forward, backward) of one layer's context-parallel communication: ring attention
    passes each rank's K and V around the cp-1 others (backward: K, V and their gradients);
    Ulysses runs four all-to-alls (q, k, v in, the output back) each way."""
    m, d = config.model, config.distributed
    if d.cp_size == 1:
        return 0.0, 0.0
    head_dim = m.hidden_size // m.num_attention_heads
    kv = 2 * tokens * m.num_key_value_heads * head_dim // d.tp_size * BF16
    if d.cp_mode == "ulysses":
        q = tokens * m.hidden_size // d.tp_size * BF16
        each = links.all_to_all(2 * q + kv, shape)
        return each, each
    size, g, k = shape
    step = links.send(kv, across_nodes=k > 1)
    return (size - 1) * step, 2 * (size - 1) * step
