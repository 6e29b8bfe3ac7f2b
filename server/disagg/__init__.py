"""Split deployments: the router, prefill workers, and the page handover between them."""
