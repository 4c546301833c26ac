"""One-pass AdamW on a CUDA device for device-placed buckets (cupy, the optional ``cupy`` extra).

A device-placed bucket's update reads its fp32 master, m and v and its grad (fp32, bf16 or fp16) and writes
the master, m, v and the bucket's 16-bit weights: one pass over memory, with no fp32 temporary for a
widened 16-bit grad and no second pass to round the master. torch's ``_fused_adamw_`` needs both (the
fallback in ``offload/runtime/device_optim.py``, and the CPU backend's path).

Numerics: the operations, their order and their fused multiply-adds are those of the host kernel
(``cpp/cpu_adam.cpp``, [Note: AdamW op order] in ``cpp/cpu_adam.h``), each written as a correctly rounded
CUDA intrinsic (``__fmul_rn``, ``__fadd_rn``, ``__fmaf_rn``, ``__fsqrt_rn``, ``__fdiv_rn``; compiled with
``--fmad=false`` so NVRTC contracts nothing else), and the 16-bit conversions are the host kernel's integer
code. The per-call scalars are computed as the host kernel computes them (in double, rounded to float once).
So a bucket updated here gets the same bits it would get from the host kernel on an x86 CPU with FMA, and
moving a bucket between tiers changes no number. ``tests/backend/test_cupy_adamw.py`` (marked ``gpu``)
checks that bit for bit against ``offload.host.cpu_adam.adamw_step``; it has not run yet: no GPU was lent
to the sessions that wrote it.

Only the backend calls this (it launches on torch's current stream of the tensors' device).
"""

from __future__ import annotations

import math
import struct
import warnings
from typing import Any

import torch

from ..errors import KernelUnavailableError

__all__ = ["adamw_step_device", "available", "coefficients", "unavailable_reason"]

_GRAD_T = {torch.float32: "float", torch.bfloat16: "unsigned short", torch.float16: "unsigned short"}
_LOAD = {  # the host kernel's exact widening, per grad dtype
    torch.float32: "g",
    torch.bfloat16: "bf16_to_float(g)",
    torch.float16: "fp16_to_float(g)",
}
_STORE = {None: "", torch.bfloat16: "lowp[i] = float_to_bf16(np);", torch.float16: "lowp[i] = float_to_fp16(np);"}

_SOURCE = r"""
__device__ __forceinline__ float bf16_to_float(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }

__device__ __forceinline__ float fp16_to_float(unsigned short h) {
  const unsigned int sign = ((unsigned int)(h & 0x8000u)) << 16;
  const unsigned int em = h & 0x7fffu;
  const unsigned int normal = (em << 13) + 0x38000000u;
  const unsigned int special = (em << 13) | 0x7f800000u;
  const float finite = __uint_as_float(sign | (em >= 0x7c00u ? special : normal));
  const float magnitude = __fmul_rn(__int2float_rn((int)em), 5.9604644775390625e-8f);  /* 0x1p-24f */
  const float subnormal = sign != 0 ? -magnitude : magnitude;
  return em < 0x0400u ? subnormal : finite;
}

__device__ __forceinline__ unsigned short float_to_bf16(float f) {
  const unsigned int u = __float_as_uint(f);
  const unsigned int rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return (unsigned short)(nan ? 0x7fc0u : rounded);
}

__device__ __forceinline__ unsigned short float_to_fp16(float f) {
  const unsigned int u = __float_as_uint(f);
  const unsigned int sign = (u >> 16) & 0x8000u;
  const unsigned int a = u & 0x7fffffffu;
  const unsigned int normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
  const unsigned int sub = __float_as_uint(__fadd_rn(fabsf(f), 0.5f)) - 0x3f000000u;
  unsigned int h = a < 0x38800000u ? sub : normal;
  h = a >= 0x477ff000u ? 0x7c00u : h;
  h = a > 0x7f800000u ? 0x7e00u : h;
  return (unsigned short)(sign | h);
}

__device__ __forceinline__ float madd(float a, float b, float c) { return MADD; }

extern "C" __global__ void offload_adamw(float* __restrict__ param, float* __restrict__ exp_avg,
                                         float* __restrict__ exp_avg_sq, const GRAD_T* __restrict__ grad,
                                         unsigned short* __restrict__ lowp, long long n, float decay,
                                         float grad_scale, float coeff, int small, float beta2,
                                         float one_minus_beta2, float inv_bc2_sqrt, float eps,
                                         float neg_step_size) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const GRAD_T g = grad[i];
    const float gs = __fmul_rn(LOAD, grad_scale);
    const float p = __fmul_rn(param[i], decay);
    const float m_old = exp_avg[i];
    const float m = madd(coeff, __fsub_rn(gs, m_old), small ? m_old : gs);
    const float v = madd(__fmul_rn(one_minus_beta2, gs), gs, __fmul_rn(exp_avg_sq[i], beta2));
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), inv_bc2_sqrt), eps);
    const float np = __fadd_rn(p, __fdiv_rn(__fmul_rn(neg_step_size, m), denom));
    param[i] = np;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    STORE
  }
}
"""

_OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")
_kernels: dict[tuple, Any] = {}
_cupy: Any = None
_cupy_error: str | None = None


def _import_cupy() -> Any:
    global _cupy, _cupy_error
    if _cupy is None and _cupy_error is None:
        try:
            import cupy  # type: ignore[import-not-found]

            _cupy = cupy
        except Exception as e:  # ImportError, or a cupy built for another CUDA failing at import
            _cupy_error = f"{type(e).__name__}: {e}"
    return _cupy


def available() -> bool:
    """Whether cupy imports here and sees a CUDA device (the one-pass kernel can run)."""
    cupy = _import_cupy()
    if cupy is None or not torch.cuda.is_available():
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    if available():
        return None
    if _cupy_error is not None:
        return f"cupy does not import ({_cupy_error}); install the `cupy` extra"
    return "no CUDA device"


def _f32(x: float) -> float:
    """``x`` rounded once to float32 (as ``static_cast<float>(double)``)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def coefficients(*, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 grad_scale: float = 1.0) -> dict[str, float | bool]:
    """The per-call scalars, as the host kernel's ``make_coeffs`` computes them: each in double, rounded to
    float once; ``w - 1`` and ``1 / bc2_sqrt`` in float (both exact IEEE float operations)."""
    s = float(step)
    w = _f32(1.0 - beta1)
    bc2_sqrt = _f32(math.pow(1.0 - math.pow(beta2, s), 0.5))
    return {
        "decay": _f32(1.0 - lr * weight_decay if weight_decay != 0 else 1.0),
        "grad_scale": _f32(grad_scale),
        "w": w,
        "w_minus_1": _f32(w - 1.0),  # exact in float: w in (0, 1]
        "small": abs(w) < 0.5,
        "beta2": _f32(beta2),
        "one_minus_beta2": _f32(1.0 - beta2),
        "inv_bc2_sqrt": _f32_div(1.0, bc2_sqrt),
        "eps": _f32(eps),
        "neg_step_size": _f32(-(lr / (1.0 - math.pow(beta1, s)))),
    }


def _f32_div(a: float, b: float) -> float:
    """``a / b`` in float32, correctly rounded (as the host kernel's ``1.0f / bc2_sqrt``)."""
    return float(torch.tensor(a, dtype=torch.float32) / torch.tensor(b, dtype=torch.float32))


def _kernel(grad_dtype: torch.dtype, lowp_dtype: torch.dtype | None, fma: bool) -> Any:
    key = (grad_dtype, lowp_dtype, fma)
    k = _kernels.get(key)
    if k is None:
        src = (_SOURCE.replace("GRAD_T", _GRAD_T[grad_dtype]).replace("LOAD", _LOAD[grad_dtype])
               .replace("STORE", _STORE[lowp_dtype])
               .replace("MADD", "__fmaf_rn(a, b, c)" if fma else "__fadd_rn(__fmul_rn(a, b), c)"))
        k = _kernels[key] = _cupy.RawKernel(src, "offload_adamw", options=_OPTIONS)
    return k


def _as_cupy(t: torch.Tensor) -> Any:
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)  # cupy has no bfloat16: the kernel reads the bits
    return _cupy.from_dlpack(t.detach())


def adamw_step_device(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                      grad_scale: float = 1.0, lowp_out: torch.Tensor | None = None, fma: bool = True) -> None:
    """One AdamW update of ``param``, ``exp_avg``, ``exp_avg_sq`` in place on their CUDA device, on torch's
    current stream there; ``lowp_out`` (bf16/fp16, or None) receives the new master rounded to nearest even.
    The tensors are contiguous 1-D CUDA tensors of one length: fp32 state, grad fp32/bf16/fp16. ``fma=False``
    gives the host kernel's numbers on an x86 CPU without FMA (its "baseline" instruction set)."""
    if not available():
        raise KernelUnavailableError(f"the one-pass device AdamW cannot run: {unavailable_reason()}")
    n = param.numel()
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if lowp_out is not None:
        tensors["lowp_out"] = lowp_out
    for name, t in tensors.items():
        if t.device != param.device or t.device.type != "cuda":
            raise ValueError(f"{name} must be on {param.device} (a CUDA device), got {t.device}")
        if t.dim() != 1 or not t.is_contiguous() or t.numel() != n:
            raise ValueError(f"{name} must be a contiguous 1-D tensor of {n} elements, got shape "
                             f"{tuple(t.shape)} and strides {t.stride()}")
    for name in ("param", "exp_avg", "exp_avg_sq"):
        if tensors[name].dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {tensors[name].dtype}")
    if grad.dtype not in _GRAD_T:
        raise TypeError(f"grad must be float32, bfloat16 or float16, got {grad.dtype}")
    if lowp_out is not None and lowp_out.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"lowp_out must be None or bfloat16/float16, got {lowp_out.dtype}")
    if n == 0:
        return
    c = coefficients(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     grad_scale=grad_scale)
    cupy, np32 = _cupy, _cupy.float32
    kernel = _kernel(grad.dtype, None if lowp_out is None else lowp_out.dtype, fma)
    stream = torch.cuda.current_stream(param.device)
    lowp = _as_cupy(lowp_out) if lowp_out is not None else _as_cupy(param)  # unused without STORE
    threads = 256
    blocks = min((n + threads - 1) // threads, 65535)
    args = (_as_cupy(param), _as_cupy(exp_avg), _as_cupy(exp_avg_sq), _as_cupy(grad), lowp, cupy.int64(n),
            np32(c["decay"]), np32(c["grad_scale"]), np32(c["w"] if c["small"] else c["w_minus_1"]),
            cupy.int32(1 if c["small"] else 0), np32(c["beta2"]), np32(c["one_minus_beta2"]),
            np32(c["inv_bc2_sqrt"]), np32(c["eps"]), np32(c["neg_step_size"]))
    with cupy.cuda.Device(param.device.index or 0), _cupy_stream(stream):
        kernel((blocks,), (threads,), args)


def _cupy_stream(stream: torch.cuda.Stream) -> Any:
    """cupy's handle on a torch stream. cupy 14 deprecates ``ExternalStream`` (a DeprecationWarning at each
    construction, seen on the GPU machine) in favour of ``Stream.from_external``, which wants the
    ``__cuda_stream__`` protocol; ``ExternalStream`` takes the raw pointer every torch version has."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _import_cupy().cuda.ExternalStream(stream.cuda_stream)
