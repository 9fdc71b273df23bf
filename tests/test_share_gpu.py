"""distributed.share_gpu on the CPU: the key and its refusal, the device and backend it picks,
the memory plan counting every rank on the one GPU, the run's first lines, and the comm
layer's host path (picotron/comm.py) forced on CPU tensors under gloo. On a GPU,
tests/test_share_gpu_gpu.py trains every layout this way."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from launch import ROOT, _env
import create_config
from picotron import comm
from picotron.config import Config, ConfigError, config_from_dict
from picotron.plan.memory_plan import estimate, memory_errors, memory_warning, ranks_per_device
from picotron.process_group_manager import device_and_backend
from picotron.run.report import config_read

SMALL = {"model": {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2},
         "training": {"micro_batch_size": 2, "seq_length": 32},
         "dataset": {"name": "synthetic"}}


def config(world=4, **distributed):
    raw = json.loads(json.dumps(SMALL))
    raw["distributed"] = {"dp_size": world, **distributed}
    return config_from_dict(raw, world_size=world)


def test_share_gpu_is_off_by_default_and_loads_on_gpu_runs():
    assert Config().distributed.share_gpu is False
    assert config(share_gpu=True).distributed.share_gpu is True


def test_share_gpu_on_cpu_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError) as e:
        config(share_gpu=True, use_cpu=True)
    problem = [ln for ln in str(e.value).splitlines() if "share_gpu" in ln]
    assert len(problem) == 1 and "distributed.use_cpu is true" in problem[0], str(e.value)
    with pytest.raises(SystemExit):             # create_config says it, without a traceback
        create_config.main(["--out_dir", str(tmp_path), "--exp_name", "bad", "--use_cpu",
                            "--set", "distributed.share_gpu=true"])
    err = capsys.readouterr().err
    assert "distributed.share_gpu puts every rank on one CUDA GPU" in err
    assert "Traceback" not in err and not (tmp_path / "bad").exists()


def test_device_and_backend(monkeypatch):
    d = SimpleNamespace(use_cpu=True, share_gpu=False)
    assert device_and_backend(d, 3) == (torch.device("cpu"), "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
        device_and_backend(SimpleNamespace(use_cpu=False, share_gpu=True), 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_and_backend(SimpleNamespace(use_cpu=False, share_gpu=False), 3) == (
        torch.device("cuda", 3), "nccl")
    # NCCL refuses two ranks on one device: every rank on cuda:0, over gloo
    assert device_and_backend(SimpleNamespace(use_cpu=False, share_gpu=True), 3) == (
        torch.device("cuda", 0), "gloo")


def test_memory_plan_counts_every_rank_on_the_shared_gpu():
    shared, alone = config(share_gpu=True), config()
    assert ranks_per_device(shared) == 4 and ranks_per_device(alone) == 1
    need = estimate(shared).device_bytes
    assert need == estimate(alone).device_bytes       # one rank's share is the same
    host = 100 * need
    # a GPU that holds two ranks: enough for one rank per GPU, not for 4 sharing it
    assert memory_errors(alone, 2 * need, host, ranks_per_host=4) == ""
    message = memory_errors(shared, 2 * need, host, ranks_per_host=4)
    assert "on the GPU (4 ranks share it" in message and "\n" not in message
    assert memory_errors(shared, 5 * need, host, ranks_per_host=4) == ""
    assert "on the GPU, 4 ranks" in memory_warning(shared, 4.1 * need, host, ranks_per_host=4)


def test_the_first_line_says_the_gpu_is_shared():
    line = config_read(config(share_gpu=True), 4)
    assert "all 4 ranks share one GPU (cuda:0)" in line and "tokens/s and MFU mean nothing" in line
    assert "share" not in config_read(config(), 4)


def test_needs_host_only_for_cuda_tensors():
    x = torch.zeros(2)
    for name in comm.GLOO_NEEDS_HOST:
        assert not comm.needs_host(name, x, None)     # CPU tensors: gloo takes them itself


def test_host_work_copies_back_once_at_wait():
    class Done:
        waited = 0

        def wait(self):
            Done.waited += 1
    device_tensor, host = torch.zeros(3), torch.arange(3.0)
    work = comm.HostWork(Done(), [(device_tensor, host)], [host])
    assert device_tensor.tolist() == [0, 0, 0]          # nothing before wait
    work.wait()
    host.fill_(9)
    work.wait()                                         # a second wait copies nothing again
    assert device_tensor.tolist() == [0, 1, 2] and Done.waited == 2


def test_every_collective_direct_and_through_the_host_path_on_cpu():
    """bench/share_gpu_probe.py's cases on CPU tensors: two gloo ranks, every collective of the
    project straight through gloo and through comm.py's host path (forced), each result
    checked against the value it must have."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "share_gpu_probe.py"),
                           "--cpu"], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if " gloo on cpu " in ln
            or " comm host copy " in ln]
    assert len(rows) == 30, proc.stdout
    assert all(ln.endswith(" ok") for ln in rows), proc.stdout
    assert sum(" comm host copy " in ln for ln in rows) == 10
