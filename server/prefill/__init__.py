"""The prefill tier (JAX): runs prompts, samples the first token, yields the KV cache to hand off."""
