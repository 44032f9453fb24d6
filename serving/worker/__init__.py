"""The device worker: the jitted step and its pools (the only owner of device arrays), the
sampler, and the sizing of the pools (with the multi-process agreement on them)."""

from serving.worker.pool_sizing import size_pools
from serving.worker.runner import ModelRunner, StepResult
from serving.worker.sampler import MAX_LOGPROBS

__all__ = ["MAX_LOGPROBS", "ModelRunner", "StepResult", "size_pools"]
