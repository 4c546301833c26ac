"""The runtime: executes a Plan through module hooks; decides nothing the planner decided."""

from .core import Runtime

__all__ = ["Runtime"]
