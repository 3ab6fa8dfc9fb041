"""Patchset registry under concurrency, and the ``prefix_sharing.setup`` entry point the README
documents. Needs no verl: a registered test patchset patches a local class."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from ps_mcore import setup
from ps_mcore.setup import registry


class Target:
    def f(self):
        return "stock"


ORIGINAL = Target.__dict__["f"]


@pytest.fixture
def slow_patchset(monkeypatch):
    """A compatible patchset (with a shared component) whose install is slow enough for two
    threads to overlap inside it."""
    calls = {"component": 0, "patchset": 0}

    def patch_component(patcher):
        calls["component"] += 1
        time.sleep(0.05)
        patcher.set(Target, "component_marker", True)

    def patch(patcher):
        calls["patchset"] += 1
        time.sleep(0.05)
        patcher.wrap(Target, "f", lambda orig: lambda self: "tree:" + orig(self))

    registry.detect()  # load the built-in patchsets first
    ps = registry.Patchset("test_slow", "test only", lambda: None, patch,
                           (registry.Component("test_component", patch_component),))
    monkeypatch.setitem(registry.PATCHSETS, ps.name, ps)
    yield ps.name, calls
    setup.uninstall([ps.name])


def test_install_from_two_threads_patches_once_and_uninstall_restores(slow_patchset):
    name, calls = slow_patchset
    start = threading.Barrier(2)
    results, errors = [], []

    def worker():
        start.wait()
        try:
            results.append(setup.install([name]))
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [[name], [name]]
    assert calls == {"component": 1, "patchset": 1}
    assert Target().f() == "tree:stock"  # wrapped once, not twice
    assert Target.f.__ps_mcore_original__ is ORIGINAL
    setup.uninstall([name])
    assert Target.__dict__["f"] is ORIGINAL and "component_marker" not in Target.__dict__
    assert name not in setup.installed()


def test_prefix_sharing_setup_exposes_the_documented_functions():
    pytest.importorskip("verl")  # the requested patchset below needs verl's stack
    from verl_helpers import fsdp_patchset

    fsdp = fsdp_patchset()
    code = (
        "import prefix_sharing.setup as s, ps_mcore.setup as m\n"
        "assert all(getattr(s, n) is getattr(m, n) for n in "
        "('install', 'uninstall', 'detect', 'requested_patchsets', 'installed'))\n"
        "status = s.detect()\n"
        "assert set(status) >= {'verl080_mcore0161_ms0160', 'verl080_fsdp', 'verl091_mcore019', 'verl091_fsdp'}, status\n"
        f"assert s.requested_patchsets() == [{fsdp!r}]\n"
        f"assert s.installed() == [{fsdp!r}]\n"
        "s.uninstall(); assert s.installed() == []\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PREFIX_SHARING_PATCHSET": fsdp}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
