"""Framework-neutral KV cache: layout, block pool, chunk codec, transfer. numpy + grpc only."""
