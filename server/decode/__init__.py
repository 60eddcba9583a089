"""The decode tier: a torch model over a paged KV cache, batched sampling, the decode loop and its service."""
