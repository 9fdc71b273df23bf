"""What a worker shares with the launcher (torchrun): its key-value store and its error file.

The store is the one the process group rendezvoused through; the watchdog keeps its
heartbeats, process ids and the step every rank stops after there
(picotron/run/watchdog.py). The error file is where torchrun's closing report reads a
failed rank's message, which it otherwise replaces by "To enable traceback...".
"""
import json
import os
import time
from datetime import timedelta

import torch.distributed as dist


def launcher_store(run: int):
    """A client of torchrun's key-value store (the one the process group rendezvoused
    through), its keys under `picotron/<run>/` (a process may train several runs in turn),
    or None when this process was not started by a launcher."""
    if "MASTER_ADDR" not in os.environ or "RANK" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=30))
    return dist.PrefixStore(f"picotron/{run}/", store)


def tell_launcher(text: str) -> bool:
    """Write `text` to torchrun's error file (TORCHELASTIC_ERROR_FILE), in the format its
    closing report reads back, so the report shows it as this rank's failure instead of "To
    enable traceback...". False when no launcher asked for one."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    with open(error_file, "w") as f:
        json.dump({"message": {"message": text, "extraInfo": {
            "py_callstack": text, "timestamp": str(int(time.time()))}}}, f)
    return True
