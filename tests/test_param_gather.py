"""ZeRO-1/2's parameter all-gather overlapped with the next forward
(picotron/data_parallel/param_gather.py): launched first-used first, each block waiting for its
own buckets as it starts, everything waited before anything reads parameters outside a forward.
The numbers it gathers are the ZeRO parity tests' business (test_data_parallel.py, test_4d.py:
they run through these hooks); here one rank in-process checks the order and the waits."""
import torch
import torch.distributed as dist

import create_config
import train
from picotron.config import load_config
from picotron.data_parallel import GradBuckets
from picotron.data_parallel.param_gather import ParamGather
from picotron.process_group_manager import ProcessGroupManager

TINY = ["--use_cpu", "--set", "model.hidden_size=64", "--set", "model.intermediate_size=160",
        "--num_hidden_layers", "3", "--seq_len", "16", "--mbs", "2",
        "--set", "distributed.bucket_size_mb=0.02"]        # ~5k fp32 elements: a few a layer


def build(tmp_path, *extra):
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "g", *TINY, *extra])
    config = load_config(path)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pgm = ProcessGroupManager(dp=1)
    model = train.build_model(config, pgm, torch.device("cpu"))
    grads = GradBuckets(model, pgm, config)
    # one rank shards nothing, so GradBuckets gathers nothing: give it a gather of one shard
    grads.gather = ParamGather(model, grads.buckets, grads.bucket_of, pgm.cp_dp_group, 0,
                               config.distributed.overlap_param_gather)
    return model, grads


def layer_buckets(model, grads):
    """Bucket indices of each decoder layer, in forward order."""
    index = {id(b): i for i, b in enumerate(grads.buckets)}
    return [{index[id(grads.bucket_of[id(p)])] for p in layer.parameters()}
            for layer in model.layers.values()]


def test_gathers_start_first_used_first_and_each_layer_waits_for_its_own(tmp_path):
    model, grads = build(tmp_path)
    gather = grads.gather
    per_layer = layer_buckets(model, grads)
    assert len(grads.buckets) > 6 and all(per_layer)
    order = gather.launch_order
    assert sorted(order) == list(range(len(grads.buckets)))
    # the root's buckets (embedding, final norm, head) first, then layer 0's, 1's, 2's
    position = {i: k for k, i in enumerate(order)}
    firsts = [min(position[i] for i in ids) for ids in per_layer]
    assert firsts == sorted(firsts)
    grads.all_gather_params()
    assert set(gather.pending) == set(order)              # all in flight, none waited yet
    seen_at_layer = []
    for layer in model.layers.values():                    # what is still pending as each
        layer.register_forward_pre_hook(                   # layer starts (after its own wait)
            lambda m, args: seen_at_layer.append(set(gather.pending)))
    model(torch.randint(0, 256, (2, 16)))
    assert not gather.pending
    for k, ids in enumerate(per_layer):
        assert not ids & seen_at_layer[k]                  # its own buckets were waited for
    later = set().union(*per_layer[1:]) - per_layer[0]
    assert later and later <= seen_at_layer[0]             # later layers' were still in flight


def test_finish_and_full_parameters_wait_for_gathers_no_forward_used(tmp_path):
    model, grads = build(tmp_path)
    grads.all_gather_params()
    with grads.full_parameters():
        assert not grads.gather.pending
    grads.all_gather_params()
    grads.sync = False
    grads.finish()                     # before the optimizer writes the shards again
    assert not grads.gather.pending


def test_without_overlap_the_gathers_are_waited_at_once(tmp_path):
    model, grads = build(tmp_path, "--set", "distributed.overlap_param_gather=false")
    grads.all_gather_params()
    assert not grads.gather.pending
    assert grads.gather.wait_log == grads.gather.launch_order


def test_under_cuda_graphs_the_gathers_are_waited_at_once(tmp_path, monkeypatch):
    """A replayed graph skips the layers' pre-hooks, where the overlapped gathers wait: the
    plug-in must turn the overlap off, or a replay would read half-gathered weights."""
    from picotron.speed import cuda_graphs
    model, grads = build(tmp_path)
    assert grads.gather.overlap
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", lambda stack, args: stack)
    cuda_graphs.capture_layers(model, load_config(tmp_path / "g" / "config.json"), "cpu",
                               grads)
    grads.all_gather_params()
    assert not grads.gather.pending
    assert grads.gather.wait_log == grads.gather.launch_order
