"""offload: train a model whose weights and optimizer state do not fit on one GPU, on that GPU.

    opt = offload.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    engine = offload.wrap(model, opt, budget="8GiB")
    loss = engine(x).loss; loss.backward(); opt.step(); opt.zero_grad()
"""

from .api import Engine, wrap
from .config import LossScaleConfig, OffloadConfig, format_bytes, parse_bytes
from .errors import (
    AlreadyWrappedError,
    BudgetTooSmallError,
    CheckpointError,
    EngineClosedError,
    HostMemoryError,
    InvariantError,
    KernelUnavailableError,
    NonFiniteNormError,
    OffloadError,
    OffloadWarning,
    OptimizerBoundError,
    ReportError,
    StreamError,
)
from .optim import AdamW
from .summary import memory_line, memory_table, print_memory
from .tools.timeline import Timeline

__all__ = [
    "AdamW",
    "AlreadyWrappedError",
    "BudgetTooSmallError",
    "CheckpointError",
    "Engine",
    "EngineClosedError",
    "HostMemoryError",
    "InvariantError",
    "KernelUnavailableError",
    "LossScaleConfig",
    "NonFiniteNormError",
    "OffloadConfig",
    "OffloadError",
    "OffloadWarning",
    "OptimizerBoundError",
    "ReportError",
    "StreamError",
    "Timeline",
    "format_bytes",
    "memory_line",
    "memory_table",
    "parse_bytes",
    "print_memory",
    "wrap",
]

__version__ = "0.1.0"
