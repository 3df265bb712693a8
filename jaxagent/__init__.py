"""jaxagent: JAX-native agentic reinforcement learning for language models."""

__version__ = "0.1.0"
