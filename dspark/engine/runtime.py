"""Process-wide settings: deterministic kernels and the CPU allocator. Both act on the whole process, so the
`dspark` commands, the training and regeneration entry points and the test suite call them before work starts."""
from __future__ import annotations

import os

import torch


def set_deterministic(enabled: bool = True) -> None:
    """Deterministic mode (docs/RELIABILITY.md): the same inputs, seeds, batch composition, device and software
    give bitwise-identical outputs, and an op without a deterministic kernel raises instead of varying.

    Sets CUBLAS_WORKSPACE_CONFIG=:4096:8 (unless already set; cuBLAS reads it when CUDA starts, so call this
    before the host is loaded), torch.use_deterministic_algorithms, cudnn deterministic without autotuning, and
    turns TF32 off (fp32 matmuls and convolutions in full precision). `enabled=False` restores torch's defaults.
    Sampling noise needs none of this: it is counter-based (dspark.engine.sampling), never a stateful generator.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = not enabled  # torch's default is True for convolutions
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's default is False for matmuls
    torch.set_float32_matmul_precision("highest")


def tune_cpu_allocator() -> bool:
    """Keep freed tensor memory in the process instead of handing it back to the OS (glibc only; a no-op that
    returns False elsewhere or when DSPARK_MALLOC_TUNING=0).

    Why by hand: glibc serves every block over a few MiB with a fresh mmap and unmaps it on free, so each training
    step on a CPU re-faults hundreds of MB of logits and host distributions; keeping them makes a training step
    faster for a larger peak RSS, with identical losses (benchmarks/results/cpu/allocator.md). PyTorch's
    CPU tuning guide prescribes jemalloc / tcmalloc through LD_PRELOAD, which must happen before the process
    starts; mallopt(3) reaches the same effect from inside it. Process-wide: the `dspark` commands and the test
    suite call it; library users opt in. Results are unchanged (allocation placement only)."""
    import ctypes
    import ctypes.util

    if os.environ.get("DSPARK_MALLOC_TUNING", "1") == "0" or not hasattr(os, "confstr"):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except (OSError, ValueError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>
    # no mmap for large blocks (they come from the heap and are reused), and never trim the heap top back
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))
