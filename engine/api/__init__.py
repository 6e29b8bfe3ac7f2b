"""What a server sees of the engine: requests, sampling parameters, outputs, the clients."""
