"""jaxaccel: techniques that make transformer training faster and leaner in JAX/Flax."""

__version__ = "0.1.0"
