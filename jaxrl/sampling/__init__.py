"""Jitted batched generation: prefill + while-loop decode, sampling controls, log-probs."""
from jaxrl.sampling.sampler import (Generation, SampleOutput, choose_layer_loop, choose_kernels,
                                    generate, sample)
from jaxrl.sampling.sampling_fns import Decoding

__all__ = ["Decoding", "Generation", "SampleOutput", "choose_layer_loop", "choose_kernels",
           "generate", "sample"]
