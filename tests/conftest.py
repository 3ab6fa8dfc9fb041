"""Shared fixtures and checks of the test suite.

* ``gpu`` marker: ``@pytest.mark.gpu`` (one CUDA GPU) or ``@pytest.mark.gpu(n)`` (n GPUs, e.g.
  one per rank of an NCCL world); such tests are skipped, with the reason, where there are
  fewer. GPU test modules set ``pytestmark = pytest.mark.gpu`` and keep what needs CUDA out of
  their import.
* Fixtures: ``fresh_warnings`` (one-time warnings given again), ``monkeypatch_module``,
  ``te_gpu_world`` (Transformer Engine on an NCCL world of one).
* Checks (``from conftest import ...``): :func:`grads_of`, :func:`assert_grads_close`,
  :func:`assert_rows_close`; :func:`run_schedule` runs a mini-batch plan's steps by hand.

Forest generators live in ``forests.py``. ``tests/`` is on ``sys.path`` under pytest (this
file's directory, rootdir-style conftest), so test modules import its helper modules by name;
subprocess workers get it through ``PYTHONPATH``.
"""

from __future__ import annotations

import pytest
import torch

# ----------------------------------------------------------------------------- gpu marker


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    available = None
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        available = _cuda_devices() if available is None else available
        need = int(marker.args[0]) if marker.args else 1
        if available < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU{'s' if need > 1 else ''}"
                                                    f" ({available} here)"))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which one-time warnings were given, so the test sees its own."""
    from ps_mcore.integrations import patching

    monkeypatch.setattr(patching, "_WARNED", set())


@pytest.fixture(scope="module")
def te_gpu_world():
    """Transformer Engine through megatron-core on an NCCL world of one, for GPU modules that
    build TE specs (``pytest.mark.usefixtures("te_gpu_world")``). Skips, naming the reason,
    where TE does not import or megatron-core does not see it; TE is imported here, not when the
    module is collected (it cannot import without CUDA)."""
    pytest.importorskip("transformer_engine")
    from megatron.core.models.gpt import gpt_layer_specs

    if not gpt_layer_specs.HAVE_TE:
        pytest.skip("megatron-core does not see transformer-engine")
    from megatron_shims import init_gpu_megatron

    init_gpu_megatron()


@pytest.fixture(scope="module")
def monkeypatch_module():
    """``monkeypatch`` for module-scoped fixtures: undone after the module's last test."""
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


# ----------------------------------------------------------------------------- checks


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient of ``module`` by name (a sharded one as its full tensor;
    parameters without a gradient left out), copied; then the module's gradients are cleared."""
    grads = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.clone()
    module.zero_grad(set_to_none=True)
    return grads


def assert_grads_close(got: dict, ref: dict, rtol: float = 1e-4, atol: float = 1e-5,
                       scale: str = "tensor") -> None:
    """The same parameters, each gradient close to the reference: relative ``rtol`` plus an
    absolute ``atol`` times the largest reference entry of the tensor (``scale="tensor"``: a
    zero reference fails, it would test nothing) or of the whole model (``scale="model"``:
    for gradients that are zero in theory and float noise on both sides)."""
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    model_scale = max(float(r.abs().max()) for r in ref.values())
    for name, r in ref.items():
        if scale == "tensor":
            s = float(r.abs().max())
            assert s > 0, f"{name}: zero reference gradient, the test would not test it"
        else:
            s = model_scale
        torch.testing.assert_close(got[name], r, rtol=rtol, atol=atol * s, msg=lambda m, n=name: f"{n}: {m}")


def row_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``[rows]`` float64: the largest absolute error of each row (first dim) of ``got``."""
    diff = got.detach().double() - ref.detach().double().to(got.device)
    return diff.abs().reshape(diff.size(0), -1).amax(1) if diff.numel() else diff.new_zeros(diff.size(0))


def assert_rows_close(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "rows", *,
                      row_tol: float = 0.0, baseline: torch.Tensor | None = None,
                      baseline_factor: float = 2.0, zero_ok: bool = False) -> None:
    """Every row (first dim) of ``got`` close to ``ref``: its largest absolute error, not a norm
    over all rows (one wrong row of thousands hides in a Frobenius error). A row's bound is
    ``tol`` times the largest entry of ``ref`` plus ``row_tol`` times the largest entry of its
    own reference row (one rounding of it, say); with ``baseline`` (the stock run of the same
    computation at the same precision) plus ``baseline_factor`` times the stock run's own
    error on that row plus the stock run's largest row error: two roundings of one row differ
    by chance (a row of the tree may take a few more roundings than the same row of the stock
    run), while a wrong row (a key missed or a sample's gradient dropped) is off by a share of
    its own values, far above the noise the stock run reaches anywhere. The failure names the
    worst row. A reference that is zero everywhere
    fails (the check would test nothing) unless ``zero_ok`` (a gradient that is zero in theory)."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    ref = ref.detach().double().to(got.device)
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    assert scale > 0 or zero_ok, f"{what}: zero reference, the test would not test it"
    err = row_errors(got, ref)
    bound = tol * scale + row_tol * ref.abs().reshape(ref.size(0), -1).amax(1)
    if baseline is not None:
        stock = row_errors(baseline, ref)
        bound = bound + baseline_factor * stock + (float(stock.max()) if stock.numel() else 0.0)
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"{what}: row {worst} of {err.numel()} off by {float(err[worst]):.3g} > bound {float(bound[worst]):.3g} "
        f"({int((err > bound).sum())} rows over; max |ref| {scale:.3g})")


def run_schedule(plan, run_call, loss=None, dtype=torch.float32) -> torch.Tensor:
    """Every step of ``plan`` (a :class:`~ps_mcore.minibatch.MiniBatchPlan`) as a training loop
    runs them: forward, ``loss(outputs, tokens).backward()`` (``tokens``: the step's global
    token indices ``[N_step]``), release; then the last releases. Without ``loss`` forward only.
    Returns the log-probs ``[N]`` (``outputs["log_probs"]``; ``outputs["o"]`` when there are
    none) and asserts nothing stays kept."""
    from ps_mcore.schedule import ScheduleRunner

    runner = ScheduleRunner(plan, run_call, training=loss is not None)
    got = None
    for j, step in enumerate(plan.steps):
        out = runner.forward(j)
        tokens = torch.from_numpy(plan.sample_tokens(step.samples))
        value = out["log_probs"] if "log_probs" in out else out["o"]
        if got is None:
            got = torch.zeros(plan.tree.num_input_tokens, dtype=dtype, device=value.device)
        got[tokens.to(value.device)] = value.detach().to(dtype)
        if loss is not None:
            loss(out, tokens.to(value.device)).backward()
        runner.release(j)
    runner.finish()
    assert not runner.kept
    return got
