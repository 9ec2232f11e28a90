"""Which backends this machine can build and run, and why not (`kiln doctor`)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The instruction sets that pick ONNX Runtime's int8 kernels on x86 (MLAS): with VNNI or AMX
# a step costs a fraction of what it does with AVX2 alone, and full-range int8 weights sum
# differently without VNNI; a latency figure or a quality figure means little without them.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


@dataclass(frozen=True)
class BackendStatus:
    backend: str
    can_build: bool
    can_run: bool
    details: str


def backend_statuses() -> list[BackendStatus]:
    return [_onnxruntime_status(), _tensorrt_status(), _torch_cuda_status()]


def _onnxruntime_status() -> BackendStatus:
    try:
        import onnxruntime as ort
    except ImportError as err:
        return BackendStatus("onnxruntime", False, False, f"onnxruntime does not import: {err}")
    providers = ", ".join(ort.get_available_providers())
    return BackendStatus("onnxruntime", True, True, f"version {ort.__version__}; providers: {providers}")


def _tensorrt_status() -> BackendStatus:
    ready, why_not = tensorrt_ready()
    gpu = gpu_description() or "none found"
    if not ready:
        return BackendStatus("tensorrt", False, False, f"{why_not}; GPU: {gpu}")
    import tensorrt

    return BackendStatus("tensorrt", True, True, f"TensorRT {tensorrt.__version__}; GPU: {gpu}")


def _torch_cuda_status() -> BackendStatus:
    ready, why_not = torch_cuda_ready()
    if not ready:
        return BackendStatus("torch-cuda", False, False, why_not)
    import torch

    major, minor = torch.cuda.get_device_capability()
    try:
        import triton

        kernels = f"Triton {triton.__version__} (one-row decode kernels)"
    except ImportError:
        kernels = "no Triton (Inductor's decode step only)"
    auto = "build.backend auto builds fp32, fp16 and bf16 with it" + (" (fp32 and fp16 go to TensorRT here)" if tensorrt_ready()[0] else "")
    details = f"torch {torch.__version__}, CUDA {torch.version.cuda}; GPU: {torch.cuda.get_device_name()} (sm_{major}{minor}); {kernels}; {auto}"
    return BackendStatus("torch-cuda", True, True, details)


def torch_cuda_ready() -> tuple[bool, str]:
    """(True, "") where torch sees a CUDA GPU, else (False, why)."""
    import torch

    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA GPU (CUDA {torch.version.cuda or 'not built in'})"
    return True, ""


def tensorrt_ready() -> tuple[bool, str]:
    """(True, "") where the TensorRT build and runtime can work, else (False, why): exactly
    what they use, the tensorrt package, the CUDA runtime library (through Polygraphy, not
    torch) and a GPU that runtime reports."""
    from components.errors import BackendUnavailable
    from components.runtime.tensorrt import gpu_target, tensorrt_version

    try:
        tensorrt_version()
        gpu_target()
    except BackendUnavailable as err:
        return False, str(err)
    return True, ""


def machine_description(target: str = "cpu") -> str:
    """Where a measurement was made: the CPU's model, the cores this process may use and the
    kernel-relevant instruction sets, plus the GPU for an engine that runs on one."""
    first: dict[str, str] = {}  # the first CPU's lines of /proc/cpuinfo
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text(errors="replace").splitlines() if cpuinfo.is_file() else ():
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    model = first.get("model name") or platform.processor() or platform.machine()  # Linux's word, else platform's
    flags = set(first.get("flags", "").split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    isa = " ".join(flag for flag in KERNEL_FLAGS if flag in flags)
    described = f"{model}, {cores} cores" + (f" ({isa})" if isa else "")
    if target != "cpu":
        described += f"; GPU {gpu_description() or 'none found'}"
    return described


def gpu_description() -> str | None:
    """'name (sm_XX)' of the first NVIDIA GPU, from nvidia-smi; None where there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    name, _, capability = out.stdout.splitlines()[0].partition(",")
    return f"{name.strip()} (sm_{capability.strip().replace('.', '')})"
