"""Patchset activation: install / uninstall restore verl exactly, idempotence, env-var
selection, bad names, and ``import prefix_sharing`` through verl's own plugin hook."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("verl")

from ps_mcore import setup  # noqa: E402
from ps_mcore.integrations.env import prefix_sharing_enabled, requested_patchsets  # noqa: E402
from verl_helpers import fsdp_patchset, kv_trainer, megatron_patchset, verl_version  # noqa: E402

MCORE = megatron_patchset()


def _targets():
    """Every attribute the patchsets touch, as (owner, name) pairs."""
    import verl.models.mcore as mcore
    from verl.trainer.ppo import ray_trainer
    from verl.workers.engine.megatron import transformer_impl as impl

    from ps_mcore.integrations.verl_common.config import actor_config_classes, critic_config_classes

    kv_module, init = kv_trainer()
    pairs = [
        (mcore, "get_mcore_engine_forward_fn"),
        (impl, "prepare_micro_batches"),
        (impl, "postprocess_batch_func"),
        (impl, "get_forward_backward_func"),
        (impl.MegatronEngine, "forward_backward_batch"),
        (impl.MegatronEngine, "_build_megatron_module"),
        (impl.MegatronEngineWithLMHead, "forward_step"),
        (impl.MegatronEngineWithValueHead, "forward_step"),
        (ray_trainer.RayPPOTrainer, "_balance_batch"),
        (ray_trainer.RayPPOTrainer, "init_workers"),
        (kv_module.PPOTrainer, "_balance_batch"),
        (kv_module.PPOTrainer, init),
        (ray_trainer, "reduce_metrics"),
        (kv_module, "reduce_metrics"),
    ]
    pairs += [(cls, "__init__") for cls in actor_config_classes() + critic_config_classes()]
    return pairs


def _snapshot():
    return {(id(o), n): (n in vars(o), vars(o).get(n)) for o, n in _targets()}


@pytest.fixture
def clean():
    setup.uninstall()
    yield
    setup.uninstall()


def test_install_patches_and_uninstall_restores_exactly(clean):
    before = _snapshot()
    compatible = [name for name, status in setup.detect().items() if status.available]
    assert MCORE in compatible
    assert setup.install() == compatible
    after = _snapshot()
    changed = [k for k in before if before[k] != after[k]]
    assert len(changed) == len(before)  # every target patched
    setup.uninstall()
    assert _snapshot() == before  # the same objects, and no new class attributes
    assert setup.installed() == []


def test_install_is_idempotent(clean):
    first = setup.install(MCORE)
    snap = _snapshot()
    assert setup.install(MCORE) == first == [MCORE]
    assert _snapshot() == snap
    everything = setup.install()
    assert setup.install() == everything and everything[0] == MCORE
    setup.uninstall()
    setup.uninstall()  # nothing left: a no-op


def test_importing_ps_mcore_patches_nothing():
    code = (
        "import ps_mcore, ps_mcore.setup, ps_mcore.integrations.verl_common.config, sys\n"
        "from ps_mcore import setup\n"
        "assert setup.installed() == [], setup.installed()\n"
        "assert not any(m == 'verl' or m.startswith('verl.') for m in sys.modules), 'verl imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_import_prefix_sharing_is_quiet_and_patches_verl_as_it_is_imported():
    """``import prefix_sharing`` imports no verl / Megatron (seconds, and their import-time
    notes) and prints nothing; each engine module is patched when the program imports it."""
    code = (
        "import sys, prefix_sharing\n"
        f"assert prefix_sharing.INSTALLED == ['{MCORE}', '{fsdp_patchset()}'], prefix_sharing.INSTALLED\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('verl', 'megatron', 'transformers')]\n"
        "assert not heavy, heavy[:5]\n"
        "sys.stderr.write('IMPORTED\\n')\n"
        "import verl.models.mcore as mcore\n"
        "from verl.workers.engine.megatron import transformer_impl as mimpl\n"
        "from verl.workers.engine.fsdp import transformer_impl as fimpl\n"
        "from verl.workers.config import ActorConfig\n"
        "patched = lambda f: hasattr(f, '__ps_mcore_original__') or hasattr(f, '__wrapped__')\n"
        "targets = lambda: [mcore.get_mcore_engine_forward_fn, mimpl.MegatronEngine.forward_backward_batch,\n"
        "                   fimpl.FSDPEngineWithLMHead.prepare_model_inputs, vars(ActorConfig)['__init__']]\n"
        "assert all(map(patched, targets())), list(map(patched, targets()))\n"
        "from ps_mcore.integrations import patching\n"
        "prefix_sharing.uninstall()\n"
        "assert not any(map(patched, targets())) and not patching._HOOKS, patching._HOOKS\n"
        "print('ok')\n"
    )
    out = _python(code)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
    assert out.stderr.startswith("IMPORTED\n"), out.stderr[:2000]  # nothing printed before


def test_unknown_patchset_is_a_clear_error(clean):
    with pytest.raises(ValueError, match=r"unknown prefix-sharing patchset\(s\) \['verl999'\]") as err:
        setup.install("verl999")
    assert f"{MCORE}: available" in str(err.value)
    assert f"{fsdp_patchset()}: " in str(err.value)
    assert setup.installed() == []


@pytest.fixture
def missing_stack(monkeypatch):
    """A registered patchset whose stack is absent (every real one is present here)."""
    from ps_mcore.setup import registry

    registry.detect()  # load the built-in patchsets first
    fake = registry.Patchset("verl999_fake", "a stack nobody has", lambda: "fakelib is not installed", lambda p: None)
    monkeypatch.setitem(registry.PATCHSETS, fake.name, fake)
    return fake.name


def test_patchset_with_missing_stack_lists_what_was_detected(clean, missing_stack):
    with pytest.raises(RuntimeError, match=r"\['verl999_fake'\] requested but their stack is not installed") as err:
        setup.install([MCORE, missing_stack])
    assert f"{MCORE}: available" in str(err.value)
    assert "verl999_fake: not available (fakelib is not installed)" in str(err.value)
    assert setup.installed() == []  # nothing half-installed


def test_env_switches(monkeypatch):
    monkeypatch.delenv("ENABLE_PREFIX_SHARING", raising=False)
    assert prefix_sharing_enabled()
    for value, expected in (("0", False), ("1", True), ("false", False), ("on", True)):
        monkeypatch.setenv("ENABLE_PREFIX_SHARING", value)
        assert prefix_sharing_enabled() is expected
    monkeypatch.setenv("ENABLE_PREFIX_SHARING", "maybe")
    with pytest.raises(ValueError, match="ENABLE_PREFIX_SHARING='maybe'"):
        prefix_sharing_enabled()
    monkeypatch.setenv("PREFIX_SHARING_PATCHSET", f" {MCORE}, {fsdp_patchset()} ,")
    assert requested_patchsets() == [MCORE, fsdp_patchset()]
    monkeypatch.setenv("PREFIX_SHARING_PATCHSET", "")
    assert requested_patchsets() is None


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


def test_verl_plugin_hook_and_env_selection():
    """``VERL_USE_EXTERNAL_MODULES=prefix_sharing``: ``import verl`` loads the plugin, which
    installs the selected patchset; a bad name in PREFIX_SHARING_PATCHSET fails loudly."""
    code = (
        "import verl\n"
        "from ps_mcore import setup\n"
        "import verl.models.mcore as m\n"
        "print('INSTALLED', setup.installed(), hasattr(m.get_mcore_engine_forward_fn, '__ps_mcore_original__'))\n"
    )
    out = _python(code, VERL_USE_EXTERNAL_MODULES="prefix_sharing", PREFIX_SHARING_PATCHSET=MCORE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"INSTALLED ['{MCORE}'] True" in out.stdout
    bad = _python("import prefix_sharing", PREFIX_SHARING_PATCHSET="verl080_mcore099")
    assert bad.returncode != 0
    assert "unknown prefix-sharing patchset(s) ['verl080_mcore099']" in bad.stderr
    assert f"{MCORE}: available" in bad.stderr


def test_auto_install_skips_a_patchset_that_fails_but_explicit_raises(clean, monkeypatch):
    from ps_mcore.setup import registry

    registry.detect()  # load the built-in patchsets
    ps = registry.PATCHSETS[MCORE]

    def broken(patcher):
        raise ImportError("transformer_engine missing")

    monkeypatch.setattr(ps, "install", broken)
    before = _snapshot()
    with pytest.warns(UserWarning, match=f"patchset {MCORE} skipped: ImportError: transformer_engine missing"):
        assert MCORE not in setup.install()
    setup.uninstall()
    with pytest.raises(ImportError, match="transformer_engine missing"):
        setup.install(MCORE)
    assert _snapshot() == before  # the shared component was rolled back too


def _refusal(state):
    """A patchset's detect() entry as its refusal message (None: available)."""
    return getattr(state, "refusal", state)


def test_detect_names_the_installed_release_and_why_not_the_others():
    status = {name: _refusal(state) for name, state in setup.detect().items()}
    ours = {MCORE, fsdp_patchset()}
    assert {"verl080_mcore0161_ms0160", "verl080_fsdp", "verl091_mcore019", "verl091_fsdp"} <= set(status)
    assert all(status[name] is None for name in ours), status
    for name, refusal in status.items():
        if name not in ours:
            assert refusal is not None and f"verl {verl_version()} is installed" in refusal, (name, refusal)


def test_verl091_megatron_needs_a_bridge_and_megatron_core_019(monkeypatch):
    from ps_mcore.setup import patchsets

    def installed(versions):
        return lambda *names: next((versions[n] for n in names if n in versions), None)

    monkeypatch.setattr(patchsets, "distribution_version", installed({"verl": "0.9.1", "megatron-core": "0.16.1"}))
    assert patchsets.mcore019_refusal() == "megatron-core 0.16.1 is installed, this patchset is for 0.19.x"
    assert patchsets.verl091_refusal() is None
    assert "neither Megatron-Bridge nor mbridge" in patchsets.megatron_builder_refusal()
    for builder in ({"megatron-bridge": "0.6.2"}, {"mbridge": "0.15.1"}):
        monkeypatch.setattr(patchsets, "distribution_version", installed(builder))
        assert patchsets.megatron_builder_refusal() is None, builder
