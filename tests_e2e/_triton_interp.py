"""Triton's interpreter for vLLM's CPU build: a ``cpu`` backend that never compiles.

vLLM 0.32's CPU build turns Triton off (``vllm.triton_utils.HAS_TRITON``
False, ``triton.jit`` a placeholder) unless Triton has a backend named
``cpu``; the Triton that vLLM's environment holds (pulled in by xgrammar) has
only ``nvidia`` and ``amd``. Some paths of the CPU build need a Triton kernel
all the same: with speculative decoding on a recurrent model in
``mamba_cache_mode="align"`` it copies states with
``precopy_mamba_align_fused_kernel``, which fails without Triton (``TypeError:
'function' object is not subscriptable``). With ``TRITON_INTERPRET=1`` Triton
runs ``@triton.jit`` kernels on CPU tensors in Python, and a backend plugin
named ``cpu`` (found through its entry point) lets vLLM turn Triton on. The
plugin compiles nothing: a kernel that reached its compiler fails loudly.

:func:`interpreter_env` writes the plugin under a directory and returns the
``env`` of a runner spec that puts it on the engine's path
(``_runner.py`` adds the spec's ``PYTHONPATH`` to ``sys.path``).
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

_PACKAGE = "kvoffload_triton_cpu"

_COMPILER = """from triton.backends.compiler import BaseBackend, GPUTarget

INTERPRET = "interpret only: set TRITON_INTERPRET=1"


class InterpretOnlyBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget):
        return target.backend == "cpu"

    def hash(self):
        return "cpu-interpret-only"

    def parse_options(self, options):
        raise NotImplementedError(INTERPRET)

    def add_stages(self, stages, options, language):
        raise NotImplementedError(INTERPRET)

    def load_dialects(self, context):
        pass

    def get_module_map(self):
        return {}
"""

_DRIVER = """import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpretOnlyDriver(DriverBase):
    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError("interpret only")

    def get_current_target(self):
        return GPUTarget("cpu", 0, 1)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("interpret only")
"""


def interpreter_env(directory: Path) -> dict[str, str]:
    """Write the ``cpu`` backend plugin under ``directory``; the runner ``env`` that uses it."""
    if find_spec("triton") is None:
        raise AssertionError(
            "Triton is not installed in vLLM's environment (xgrammar pulls it in on x86-64 "
            "Linux); the interpreter needs it"
        )
    package = directory / _PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""A Triton cpu backend for TRITON_INTERPRET=1."""\n')
    (package / "compiler.py").write_text(_COMPILER)
    (package / "driver.py").write_text(_DRIVER)
    info = directory / f"{_PACKAGE}-0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {_PACKAGE}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[triton.backends]\ncpu = {_PACKAGE}\n")
    return {"TRITON_INTERPRET": "1", "PYTHONPATH": str(directory)}
