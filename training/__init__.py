"""Training the demo checkpoint: corpus, tokenizer, demo config, training loop."""
