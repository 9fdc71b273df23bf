"""The run wing: what turns the training loop into a job an operator can trust. What a run
writes and says, the faults it must notice, the checks made before a config is written, and
sampling from the result. (Whether a config fits in memory is the plan wing's question.)

Reading order (each file needs only the ones before it):
    output_paths.py        the folders and files a run writes, checked before anything is built
    run_lock.py            one run at a time in a run folder: its lock, on shared filesystems too
    metrics_log.py         metrics.jsonl, and the loggers beside it (W&B, TensorBoard)
    divergence.py          the rule that stops a run whose loss has left its best far behind
    skipped_steps.py       steps skipped for a non-finite gradient: no checkpoint of them, and
                           a run that stops or ends while skipping fails, naming where to resume
    step_log.py            one record per optimizer step, logged one step behind; progress
    launcher.py            what a worker shares with torchrun: its store and its error file
    launch_workers.py      `train.py --nproc_per_node N`: torch's launcher started from
                           train.py, ended by the workers' own line and status
    stop_signals.py        SIGTERM and Ctrl-C, heard even while the training thread is blocked
    peers.py               the other ranks on this machine, and which of them is gone
    heartbeats.py          a frozen rank told from a slow one, within a stated bound
    watchdog.py            a dead or frozen rank, a dead launcher, a stop all ranks agree on,
                           a GPU out of memory
    report.py              a run's first lines and the launch record
    run_end.py             how a run ends: its summary, a stop's line, an error said once
    preflight.py           checked on this machine before a config is written: its data and
                           tokenizer can be found
    slurm.py               `create_config.py --slurm`: a batch script for several nodes
    generate.py            sampling from a trained model: temperature, top-k, EOS
"""
