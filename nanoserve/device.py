"""What this machine runs on: the device, the dtype, and how much of the device's memory is free.
Decided once at start-up from the Config and the machine (see config.py for every derived value)."""

import logging
import platform
import warnings

import numpy as np
import psutil
import torch

X86 = ("x86_64", "amd64", "i686")  # platform.machine() of an x86 CPU, lower case


def resolve_device(name: str | None) -> torch.device:
    """Config's device -> torch.device. None picks CUDA where there is one, else the CPU.
    "mps" (Apple GPUs) runs the torch attention backend. A device this machine lacks is a ValueError."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r} is not a device name such as 'cpu', 'cuda', 'cuda:1' or 'mps'") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(device.type):
        raise ValueError(f"device {name!r} is not available on this machine (supported: cpu, cuda, mps)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(name: str, device: torch.device, saved: torch.dtype | None = None) -> torch.dtype:
    """Config's dtype name -> torch dtype.

    "auto" follows the checkpoint, as transformers and vLLM do. It starts from `saved`: the `dtype` (or
    older `torch_dtype`) of the checkpoint's config.json, as transformers parses it (`PretrainedConfig.dtype`).
    That is float32 where it names none or another dtype.
    - On CUDA, float32 becomes bfloat16, because flash-attn needs 16 bits. Below compute capability 8.0 it
      becomes float16, since those GPUs have no bfloat16 tensor cores (vLLM's rule).
    - On a CPU, "auto" keeps bfloat16 only where its matmuls beat float32 at batch decode. That is AMX on
      x86, where `why_not_native_bf16(batched=True)` is None. Else it runs float32 and logs that reason.
    A bfloat16 asked for by name obeys. Where it is emulated, a warning names why."""
    if name == "auto":
        dtype = saved if saved in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
        if device.type == "cuda" and dtype != torch.float16:
            dtype = torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
    else:
        dtype = getattr(torch, name)
    if dtype != torch.bfloat16 or device.type != "cpu":
        return dtype
    why_not = why_not_native_bf16(batched=name == "auto")
    if why_not is None:
        return dtype
    if name == "auto":
        logging.getLogger(__name__).warning(f"dtype='auto': the checkpoint is bfloat16, but on this CPU bfloat16 "
                                            f"matmuls are slower than float32 ({why_not}): running in float32")
        return torch.float32
    warnings.warn(f"this CPU has no native bfloat16 matmuls ({why_not}): bfloat16 will be slow; float32 is "
                  f"faster here", stacklevel=2)
    return dtype


def has_onednn(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies `dtype` on this CPU.
    - float32: on x86 (measured only there).
    - bfloat16: where it has bf16 kernels. That is AVX512 or newer, or Arm BF16. It is not AVX2, nor
      anything under ONEDNN_MAX_CPU_ISA=AVX2."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32 and platform.machine().lower() in X86


def why_not_native_bf16(batched: bool = False) -> str | None:
    """Why this CPU does not multiply bfloat16 natively, or None where it does. Native needs both:
    - oneDNN's bf16 kernels are on. They are off in a torch built without oneDNN, on an AVX2 CPU, under
      ONEDNN_MAX_CPU_ISA=AVX2, and on an Arm CPU without BF16 instructions.
    - On x86, AVX512-BF16 or AMX does the products. Plain AVX512 converts each to float32 first.
    With `batched`, bfloat16 must also be faster than float32 for a batch of decodes. On x86 that takes AMX.
    With AVX512-BF16 alone, 48 requests ran slower in bfloat16 than in float32 on both CPUs measured
    (docs/performance.md, "Which CPU")."""
    x86 = platform.machine().lower() in X86
    if not torch.backends.mkldnn.is_available():
        return "this torch is built without oneDNN"
    if not has_onednn(torch.bfloat16):
        return ("oneDNN has no bf16 kernels for this CPU: they need AVX-512" if x86 else
                "this Arm CPU has no BF16 instructions")
    if not x86 or torch.cpu._is_amx_tile_supported():
        return None
    if not torch.cpu._is_avx512_bf16_supported():
        return "no AVX512-BF16 nor AMX: AVX-512 converts each product to float32"
    return "no AMX: with AVX512-BF16 alone, batch decode is slower than in float32" if batched else None


def free_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device's memory. On a CPU, or with Apple's unified memory, it is the RAM
    available to a new allocation. psutil reads it the same way on Linux, macOS and Windows."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    memory = psutil.virtual_memory()
    return memory.available, memory.total


def upload(arrays: dict[str, np.ndarray | list], dtype: torch.dtype, device: torch.device | str
           ) -> dict[str, torch.Tensor]:
    """Host arrays by name -> tensors on `device` in `dtype`, each of its array's shape.

    The tensors are views of one buffer that goes up in one copy. On CUDA that copy is from pinned memory,
    with non_blocking=True. It queues behind the GPU's work, and the host goes on at once. From pageable
    memory, as in torch.tensor(list, device="cuda"), the host may wait for the GPU to finish.
    On a CPU there is no copy."""
    flat = torch.from_numpy(np.concatenate(list(arrays.values()), axis=None)).to(dtype)  # axis=None: each raveled
    if torch.device(device).type == "cuda":  # device may be a str: build_batch(..., "cpu")
        flat = flat.pin_memory()
    parts = flat.to(device, non_blocking=True).split([np.size(a) for a in arrays.values()])
    return {name: part.view(np.shape(a)) for (name, a), part in zip(arrays.items(), parts)}
