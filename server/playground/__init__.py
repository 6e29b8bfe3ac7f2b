"""The playground: a chat page at ``/`` that calls the server's own API (routes.py)."""
