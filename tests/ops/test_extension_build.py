"""Is the compiled extension there when it must be, and does everything work
when it is not?

CI sets RIDGEFILL_REQUIRE_EXTENSION=1 wherever nvcc exists (scripts/test.sh):
then a missing or unloadable `ridgefill_runtime._C` is a failure, not a quiet
fallback to slower torch code. Without the variable the fallback path is
asserted instead, so these tests never skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ridgefill_runtime import ops

REQUIRED = os.environ.get("RIDGEFILL_REQUIRE_EXTENSION") == "1"
OP = "ridgefill::rms_norm"
EXPECTED_SCHEMA = "ridgefill::rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


# Runs in a child process with `ridgefill_runtime._C` made unimportable (as
# on a pure-Python install) and checks the CPU path end to end.
FALLBACK_CHECK = """
    import sys
    sys.modules["ridgefill_runtime._C"] = None  # import now raises ModuleNotFoundError
    import torch
    import ridgefill_runtime.ops as ops
    assert not ops.extension_loaded()
    assert ops.extension_error() == "not built (pure-Python install)", ops.extension_error()
    assert not hasattr(torch.ops.ridgefill, "rms_norm")
    # rms of [3, 4] is sqrt(12.5); weight scales per column.
    x = torch.tensor([[3.0, 4.0]])
    out = ops.rms_norm(x, torch.tensor([1.0, 2.0]), 0.0)
    expected = torch.tensor([[3.0, 8.0]]) / 12.5 ** 0.5
    torch.testing.assert_close(out, expected)
    print("fallback ok")
"""


def test_extension_present_when_required():
    if REQUIRED:
        assert ops.extension_loaded(), f"RIDGEFILL_REQUIRE_EXTENSION=1 but: {ops.extension_error()}"
        assert "ridgefill_runtime._C" in sys.modules
        assert str(torch.ops.ridgefill.rms_norm.default._schema) == EXPECTED_SCHEMA
        # Checked through the dispatcher, so no GPU is needed to see it.
        assert torch._C._dispatch_has_kernel_for_dispatch_key(OP, "CUDA")
    else:
        result = run_python(FALLBACK_CHECK)
        assert result.returncode == 0 and "fallback ok" in result.stdout, result.stderr


def test_pure_python_fallback():
    # Also under REQUIRED: the fallback must keep working for CPU-only users.
    result = run_python(FALLBACK_CHECK)
    assert result.returncode == 0 and "fallback ok" in result.stdout, result.stderr


def test_unloadable_extension_warns_and_falls_back():
    # E.g. a .so built against another torch: import fails with undefined
    # symbols. That must not break imports, but must not be silent either.
    result = run_python(
        """
        import sys, warnings
        import importlib.abc

        class Broken(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "ridgefill_runtime._C":
                    raise ImportError("_C.so: undefined symbol: _ZN3c104fake")
                return None

        sys.meta_path.insert(0, Broken())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import ridgefill_runtime.ops as ops
        assert not ops.extension_loaded()
        assert "undefined symbol" in ops.extension_error()
        assert any(issubclass(w.category, RuntimeWarning) and "undefined symbol" in str(w.message) for w in caught)
        print("warned ok")
        """
    )
    assert result.returncode == 0 and "warned ok" in result.stdout, result.stderr


def test_package_import_is_light():
    result = run_python(
        """
        import sys
        import ridgefill_runtime
        assert isinstance(ridgefill_runtime.__version__, str) and ridgefill_runtime.__version__
        assert "torch" not in sys.modules and "ridgefill_runtime._C" not in sys.modules
        print("light ok")
        """
    )
    assert result.returncode == 0 and "light ok" in result.stdout, result.stderr


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_registration_on_cpu(dtype):
    """With the extension: schema, fake impl and the CPU kernel agree
    (torch.library.opcheck). Without it: the op must not half-exist."""
    if not ops.extension_loaded():
        assert not hasattr(torch.ops.ridgefill, "rms_norm")
        return
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 33, generator=gen).to(dtype)
    weight = torch.randn(33, generator=gen).to(dtype)
    torch.library.opcheck(torch.ops.ridgefill.rms_norm.default, (x, weight, 1e-5))
    torch.testing.assert_close(
        torch.ops.ridgefill.rms_norm(x, weight, 1e-5), ops.rms_norm_reference(x, weight, 1e-5), rtol=0, atol=0
    )
    # The fake must reject what the kernels reject (traced graphs fail early).
    with pytest.raises(ValueError, match="weight must be 1-D"):
        torch.ops.ridgefill.rms_norm(x.to("meta"), weight[:5].to("meta"), 1e-5)
