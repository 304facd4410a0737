"""Jitted batched generation: prefill + while-loop decode, sampling controls, log-probs."""
from jaxrl.sampling.layer_loops import choose_layer_loop
from jaxrl.sampling.sampler import Generation, SampleOutput, generate, sample
from jaxrl.sampling.sampling_fns import Decoding

__all__ = ["Decoding", "Generation", "SampleOutput", "choose_layer_loop", "generate", "sample"]
