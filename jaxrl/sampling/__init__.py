"""Sampling: the decode engine (slots, continuous batching, per-slot settings, conversations
continued in their slots), `sample` on top of it, sampling controls and log-probs."""
from jaxrl.sampling.engine import Engine
from jaxrl.sampling.requests import Request
from jaxrl.sampling.sampler import SampleOutput, sample
from jaxrl.sampling.sampling_fns import Decoding, RowSettings

__all__ = ["Decoding", "Engine", "Request", "RowSettings", "SampleOutput", "sample"]
