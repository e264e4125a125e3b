"""What the machine gives this process: the CPUs it may use, waiting for a device's queued work, and the
hardware type's name profiles are stored under.

Both read the same on a laptop and in a Kubernetes pod, on a CPU and on a GPU, so callers need no
special cases: `available_cpus()` where they would write os.cpu_count(), `sync(device)` before every
clock read that times device work.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where a container sees its own cgroup (cgroup v2 with a cgroup namespace, the Kubernetes default; v1
mounts the cpu controller at cpu/ under it)."""


def available_cpus(cgroup_root: str | Path = CGROUP_ROOT) -> int:
    """CPUs this process may use: the fewer of the cores it may be scheduled on (sched_getaffinity;
    os.cpu_count() where that does not exist) and its cgroup's CPU quota, rounded up (a pod with
    `limits.cpu: 2500m` gets 3). At least 1.

    os.cpu_count() is the host's cores: in a pod limited to 4 of a 64-core node's CPUs, torch would run
    64 threads on a 4-CPU quota, and they would spend the step waiting for each other."""
    known = [len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1]
    quota = cgroup_cpu_quota(Path(cgroup_root))
    if quota is not None:
        known.append(quota)
    return max(1, min(known))


def cgroup_cpu_quota(root: Path) -> int | None:
    """The CPU quota of the cgroup mounted at `root`, in whole CPUs rounded up; None when it has none
    or none can be read. cgroup v2: cpu.max holds "QUOTA PERIOD" ("max PERIOD": no quota); cgroup v1:
    cpu/cpu.cfs_quota_us (-1: no quota) over cpu/cpu.cfs_period_us."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
    else:
        quota, period = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
        if quota is None or period is None:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max", or a file we cannot parse: no quota we know of
        return None
    if q <= 0 or p <= 0:
        return None
    return math.ceil(q / p)


def sync(device: torch.device | str) -> None:
    """Wait until `device` has run all the work queued on it. A GPU runs kernels asynchronously, so a
    clock read without this measures how long launching them took, not running them; a CPU computes
    in the call, and there is nothing to wait for."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _read(file: Path) -> str | None:
    try:
        return file.read_text().strip()
    except OSError:
        return None


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo: avx2, fma, avx512_bf16, ...); empty where unreadable."""
    for line in (_read(Path("/proc/cpuinfo")) or "").splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def detect_gpu_type() -> str:
    """`NVIDIA_H100`-style name of the first CUDA device (`gpu_type_name`), else `cpu-<N>core`."""
    try:
        import torch

        if torch.cuda.is_available():
            return gpu_type_name(torch.cuda.get_device_name(0))
    except Exception:  # no usable CUDA: profile as CPU
        pass
    return f"cpu-{os.cpu_count()}core"


def gpu_type_name(device_name: str) -> str:
    """The hardware type of a CUDA device name: its words up to the first one with a digit in it.

    So memory and form-factor variants share one profile (`NVIDIA A100-SXM4-80GB` -> `NVIDIA_A100`,
    `NVIDIA H100 80GB HBM3` -> `NVIDIA_H100`), while brand words stay in and the model number with
    them (`NVIDIA GeForce RTX 4090` -> `NVIDIA_GeForce_RTX_4090`, not a `NVIDIA_GeForce` every
    GeForce card would share). CPUs are named `cpu-<cores>core` since their speed scales with cores.
    """
    words = [w for w in re.split(r"[\s-]+", device_name) if w]
    n = next((i + 1 for i, w in enumerate(words) if any(c.isdigit() for c in w)), min(len(words), 2))
    return "_".join(words[:n])
