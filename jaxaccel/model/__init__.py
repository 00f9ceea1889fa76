"""Layer 3, the model: the contract any Flax NNX model meets (nn, contract), attention and its
kernels, jaxaccel's GPT."""
