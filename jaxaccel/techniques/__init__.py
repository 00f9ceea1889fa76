"""Layer 5, the techniques: one module each, transforming a model, its step or its data, and the
registry that composes them."""
