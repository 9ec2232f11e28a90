"""Run the real `tritonserver` that PyPI's nvidia-pytriton bundles on a model repository
(`kiln export triton`'s), from the Triton environment `make triton-env` builds:

    .triton-venv/bin/python -m flows.triton_server --model-repository DIR [--http-port 8000 ...]

PyTriton normally starts that server for models it defines in Python; a plain model
repository needs the preparation it makes (`_prepare_triton_inference_server`, done here
once per environment): the server's files with the Python backend stub built for this
interpreter, and its bundled libraries on LD_LIBRARY_PATH. Every argument
after the module's own is passed to tritonserver unchanged.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path


def prepared_server() -> tuple[Path, Path, dict[str, str]]:
    """(tritonserver binary, backend directory, environment), the server's files prepared
    once inside this environment (`<venv>/kiln-tritonserver`)."""
    from pytriton.utils.distribution import get_libs_path, get_root_module_path, get_stub_path

    server = Path(sys.prefix) / "kiln-tritonserver"
    if not (server / "backends" / "python" / "triton_python_backend_stub").is_file():
        staging = Path(tempfile.mkdtemp(prefix=".kiln-tritonserver-", dir=sys.prefix)) / "server"
        shutil.copytree(get_root_module_path() / "tritonserver", staging, ignore=shutil.ignore_patterns("python_backend_stubs"))
        shutil.copy(get_stub_path(f"{sys.version_info[0]}.{sys.version_info[1]}"), staging / "backends" / "python" / "triton_python_backend_stub")
        shutil.rmtree(server, ignore_errors=True)
        staging.rename(server)
        shutil.rmtree(staging.parent, ignore_errors=True)
    env = os.environ.copy()
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (env.get("LD_LIBRARY_PATH"), str(get_libs_path())) if p)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the stub's Python: this environment
    return server / "bin" / "tritonserver", server / "backends", env


def main(arguments: list[str]) -> None:
    binary, backends, env = prepared_server()
    os.execve(binary, [str(binary), f"--backend-directory={backends}", *arguments], env)


if __name__ == "__main__":
    main(sys.argv[1:])
