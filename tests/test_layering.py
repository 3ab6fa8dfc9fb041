"""The package layout: the floors import one way."""

from __future__ import annotations

import subprocess
import sys


def _imported_after(code: str) -> set[str]:
    """Top-level package names in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    probe = code + "\nimport sys\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_lower_floors_import_no_framework():
    """Core, ``mindspeed``, ``setup`` (detecting stacks) and ``analyze`` (which reads the verl
    glue's config defaults) import no training framework."""
    code = (
        "import ps_mcore, ps_mcore.attention, ps_mcore.logprobs, ps_mcore.flops, ps_mcore.recurrent\n"
        "import ps_mcore.multi_token, ps_mcore.multimodal\n"
        "import ps_mcore.mindspeed, ps_mcore.setup, ps_mcore.analyze\n"
        "ps_mcore.setup.detect()"
    )
    frameworks = {"verl", "megatron", "transformers", "mindspeed", "torch_npu", "transformer_engine"}
    assert not _imported_after(code) & frameworks


def test_one_backend_table_serves_every_caller():
    from ps_mcore.attention import BACKENDS, backends
    from ps_mcore.layer_specs.parallel.context_parallel import CP_BACKENDS

    assert BACKENDS == ("auto", *backends.ATTENTION_BACKENDS)
    assert CP_BACKENDS == ("auto", *(n for n, b in backends.ATTENTION_BACKENDS.items() if b.supports_cp))
    assert "reference" in BACKENDS and "reference" not in CP_BACKENDS and "chunked" in CP_BACKENDS
