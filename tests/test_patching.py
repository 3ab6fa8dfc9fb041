"""Patches deferred until their module is imported (``Patcher.when_imported``), and what the
patchset registry does when such a patch fails at the program's import. Needs no verl: the
patched modules are written to a temporary folder."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import textwrap
import uuid

import pytest

from ps_mcore import setup
from ps_mcore.integrations import patching
from ps_mcore.integrations.patching import Patcher
from ps_mcore.setup import registry


@pytest.fixture
def make_module(tmp_path, monkeypatch):
    """``make_module(source) -> name``: a fresh, not yet imported module on ``sys.path``."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def make(source: str, name: str | None = None) -> str:
        name = name or f"ps_test_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield make
    for name in names:
        sys.modules.pop(name, None)


def _tag(patcher: Patcher):
    return lambda mod: patcher.wrap(mod, "f", lambda original: lambda: "tree:" + original())


def test_a_module_imported_later_is_patched_before_its_importer_sees_it(make_module):
    target = make_module("def f():\n    return 'stock'\n")
    user = make_module(f"from {target} import f\nseen = f()\n")  # binds the name at import
    patcher = Patcher()
    patcher.when_imported(target, _tag(patcher))
    assert target not in sys.modules and len(patcher) == 0  # nothing imported, nothing patched
    mod = importlib.import_module(user)
    assert mod.seen == "tree:stock" and mod.f() == "tree:stock"
    assert isinstance(sys.modules[target].__loader__, importlib.machinery.SourceFileLoader)
    assert target not in patching._HOOKS  # ran once, then forgotten
    patcher.restore()
    assert sys.modules[target].f() == "stock"


def test_an_imported_module_is_patched_at_once_and_restore_cancels_waiting_patches(make_module):
    loaded = make_module("def f():\n    return 'stock'\n")
    later = make_module("def f():\n    return 'stock'\n")
    importlib.import_module(loaded)
    patcher = Patcher()
    patcher.when_imported(loaded, _tag(patcher))
    patcher.when_imported(later, _tag(patcher))
    assert sys.modules[loaded].f() == "tree:stock" and len(patcher) == 1
    patcher.restore()
    assert sys.modules[loaded].f() == "stock"
    assert later not in patching._HOOKS
    assert importlib.import_module(later).f() == "stock"  # cancelled: never patched


def test_a_failing_patch_of_an_imported_module_raises_at_once(make_module):
    loaded = make_module("x = 1\n")
    importlib.import_module(loaded)
    patcher = Patcher(on_deferred_error=lambda module, err: pytest.fail("not deferred"))
    with pytest.raises(AttributeError):
        patcher.when_imported(loaded, lambda mod: patcher.wrap(mod, "missing", lambda o: o))


@pytest.fixture
def deferred_patchset(make_module, monkeypatch):
    """A registered patchset (stack present) whose patch waits for a module and fails there."""
    target = make_module("x = 1\n")

    def install(patcher):
        patcher.when_imported(target, lambda mod: patcher.wrap(mod, "renamed_in_a_new_release", lambda o: o))

    registry.detect()  # load the built-in patchsets first
    ps = registry.Patchset("test_deferred", "test only", lambda: None, install)
    monkeypatch.setitem(registry.PATCHSETS, ps.name, ps)
    yield ps.name, target
    setup.uninstall([ps.name])


def test_a_deferred_patch_that_fails_removes_an_auto_selected_patchset_with_a_warning(deferred_patchset):
    name, target = deferred_patchset
    try:
        assert name in setup.install()  # every available patchset, this one included
        with pytest.warns(UserWarning, match=rf"\['{name}'\] could not patch {target} \(AttributeError"):
            importlib.import_module(target)  # the program's own import still succeeds
        assert name not in setup.installed()
    finally:
        setup.uninstall()


def test_a_deferred_patch_that_fails_raises_from_the_import_when_requested_by_name(deferred_patchset):
    name, target = deferred_patchset
    assert name in setup.install([name])
    with pytest.raises(RuntimeError, match=rf"\['{name}'\] could not patch {target}"):
        importlib.import_module(target)
    assert name not in setup.installed() and target not in patching._HOOKS


def test_detect_says_available_or_why_not():
    ok, missing = registry.StackStatus(), registry.StackStatus("verl is not installed")
    assert ok.available and ok and str(ok) == "available" and ok.refusal is None
    assert not missing.available and not missing
    assert repr({"x": missing}) == "{'x': not available (verl is not installed)}"
    status = setup.detect()
    assert status and all(isinstance(s, registry.StackStatus) for s in status.values())
