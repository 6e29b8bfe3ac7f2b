"""Model runners: a step's rows through the model over paged KV; decode-step CUDA graphs."""
