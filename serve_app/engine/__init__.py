"""The hot path: the scheduler (admit, step, evict, stream), the model workers and their KV state,
speculative acceptance and sampling, the policy that picks k, step statistics and text streaming."""
