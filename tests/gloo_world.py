"""Run a script in a fresh Python process on a CPU gloo world of one: real FSDP wrappers
without a process group leaking into the test process (or into other xdist tests); and the
process group of a torchrun worker (:func:`init_torchrun_world`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_PREAMBLE = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
"""


def init_torchrun_world(device: str):
    """In a torchrun worker: the process group (NCCL on this rank's GPU for ``"cuda"``, else
    gloo) and the device to run on."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl")
        return dev
    dist.init_process_group("gloo")
    return torch.device("cpu")


def run_in_gloo_world(body: str, timeout: int = 300) -> str:
    """Run ``body`` (Python source; ``torch``, ``dist`` imported, ``tests/`` importable) after
    the world is up; asserts it exits 0 and returns its stdout."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)}
    script = _PREAMBLE + textwrap.dedent(body) + "\ndist.destroy_process_group()\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout
