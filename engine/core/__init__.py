"""The step loop: schedule, run, sample, append, detokenize, stop; and its process."""
