"""Layer 2, data: corpora, tokenizers, batching strategies, the loader and importance sampling."""
