"""From logits to tokens: the sampler and prompt-token scores."""
