"""moeserve's engine: model code, weights loading, paged KV cache, continuous batching."""

from inference.engine import LLMEngine
from inference.errors import EngineDeadError, InvalidParameterError, ModelLoadError, QueueFullError
from inference.outputs import CompletionOutput, RequestOutput, StepStats
from inference.sampling_params import SamplingParams, StructuredOutputs

__all__ = [
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineDeadError",
    "InvalidParameterError",
    "LLMEngine",
    "ModelLoadError",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
    "StepStats",
    "StructuredOutputs",
]


def __getattr__(name):  # the async engine pulls in asyncio/threading only when used
    if name == "AsyncLLMEngine":
        from inference.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)
