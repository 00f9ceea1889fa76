"""What the device can do: peak FLOP/s for model FLOPs utilisation, and its memory use (and
whether an error is its running out). It imports jax only in the functions that ask a device, so
that a command's ``--help`` (``experiments.common``) imports none.
"""

import os

# Dense bf16 tensor-core peaks in FLOP/s from the vendors' data sheets (SXM parts).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def peak_flops(device=None) -> float | None:
    """The device's dense bf16 peak, or None where it is not known (CPUs, other GPUs)."""
    import jax
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "")
    return next((flops for name, flops in PEAK_BF16_FLOPS.items() if name in kind), None)


def describe(device=None) -> str:
    import jax
    device = device or jax.devices()[0]
    return f"{jax.device_count()} x {device.device_kind} ({device.platform})"


def peak_memory_bytes(device=None) -> int | None:
    """Peak bytes in use on the device since start, where the backend reports it (GPUs do);
    by default on this process's first device."""
    import jax
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return stats.get("peak_bytes_in_use") if stats else None


def memory_limit_bytes(device=None) -> int | None:
    """The bytes XLA may allocate on the device (its ``bytes_limit``), where the backend reports
    it (GPUs and TPUs do; the CPU does not); by default on this process's first device."""
    import jax
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def host_memory_bytes() -> int:
    """The host memory this process may still take: Linux's ``MemAvailable``, within a cgroup
    (v2) memory limit where one is set; elsewhere the physical memory."""
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    except (OSError, ValueError, IndexError):
        pass
    free = fields.get("MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit, used = f.read().strip(), int(g.read())
        if limit.isdigit():
            free = min(free, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return free


def device_memory_bytes(device=None) -> int:
    """The bytes one device can hold: its ``memory_limit_bytes`` where the backend reports it;
    on the CPU, which reports none, the host's available memory (``host_memory_bytes``) shared
    by this process's devices."""
    import jax
    limit = memory_limit_bytes(device)
    if limit is not None:
        return limit
    return host_memory_bytes() // max(1, jax.local_device_count())


def memory_owner(device=None) -> str:
    """What ``device_memory_bytes`` measures, in words."""
    return "this host's available memory" if memory_limit_bytes(device) is None \
        else "this device's memory"


FINAL_EVAL_NOTE = "jaxaccel: during the final evaluation"   # on an OOM error raised there


def out_of_memory(error: BaseException) -> bool:
    """An allocation failure: Python's MemoryError, or a ``JaxRuntimeError`` /
    ``XlaRuntimeError`` that says RESOURCE_EXHAUSTED or "out of memory" (a GPU allocation
    failing inside a kernel's call is reported in another status)."""
    text = str(error)
    return isinstance(error, MemoryError) or (
        type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
        and ("RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()))
