"""HTTP plumbing every API shares: keys, body limits, timeouts, the one error shape, SSE."""
