"""The plain-Python core: requests, the scheduler, the cache manager and its pools, the plan.

No jax, jaxlib or flax anywhere in this package (``tests/test_structure.py`` checks), so it
runs and is tested without a device; it imports nothing from the other boxes of ``serving/``.
"""

from serving.core.config import CacheConfig, SchedulerConfig
from serving.core.plan import SamplingArrays, StepPlan, StepShape
from serving.core.request import (
    EngineRequest,
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
)
from serving.core.scheduler import Scheduler, SchedulerStats
from serving.core.scheduler_output import RequestUpdate, SchedulerOutput

__all__ = [
    "CacheConfig",
    "EngineRequest",
    "FinishReason",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "SamplingArrays",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "StepPlan",
    "StepShape",
]
