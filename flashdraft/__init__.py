"""flashdraft: an LLM inference engine built around DFlash speculative decoding."""

from flashdraft.engine.llm import LLM
from flashdraft.engine.sequence import Output
from flashdraft.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "GuidedDecodingParams", "Output", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
