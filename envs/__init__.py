"""Environment tier: tools, sandbox and verifiers. Never imports JAX."""
