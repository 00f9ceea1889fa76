"""jaxaccel: techniques that make transformer training faster and leaner in JAX/Flax.

Seven packages, one per layer, lowest first; a module imports only from its own layer and those
below it (tests/test_layout.py): ``core`` (errors, settings, sections, sharding), ``data``,
``model`` (the contract, attention and its kernels, the GPT), ``step`` (the pure train step),
``techniques`` (one module each, and their registry), ``run`` (config, the loop, checkpoints)
and ``outputs`` (generate, export). docs/DESIGN.md draws them.

Shape legend. An array's name ends in the letters of its dimensions, in order (``x_BTD`` is
[batch, tokens, d_model]); each letter means one thing everywhere in the library and its tests:

    B  batch rows                          V  vocabulary
    T  tokens per row (queries)            S  key/value tokens (attention)
    D  model width, d_model                F  MLP inner width, d_ff
    H  query heads                         K  key/value heads
    G  query heads per key/value head      E  features per head, head_dim
    R  rotary frequencies, head_dim / 2    L  layers
    M  microbatches                        N  documents
    W  rows of an epoch's plan             Z  batches of an epoch
    Q  row segments, one document each     P  pieces of documents to pack
    U  length buckets                      C  candidate bucket lengths
    A  real (input, target) pairs          I  query tiles (flash attention)
    J  key tiles (flash attention)
"""

__version__ = "0.1.0"
