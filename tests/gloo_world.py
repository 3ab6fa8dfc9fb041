"""Run a script in a fresh Python process on a CPU gloo world of one: real FSDP wrappers
without a process group leaking into the test process (or into other xdist tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_PREAMBLE = """\
import sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
"""


def run_in_gloo_world(body: str, timeout: int = 300) -> str:
    """Run ``body`` (Python source; ``torch``, ``dist`` imported, ``tests/`` importable) after
    the world is up; asserts it exits 0 and returns its stdout."""
    script = _PREAMBLE.format(tests=os.path.dirname(os.path.abspath(__file__)))
    script += textwrap.dedent(body) + "\ndist.destroy_process_group()\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout
