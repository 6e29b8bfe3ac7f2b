"""The Anthropic Messages API (as DeepSeek serves it at ``/anthropic``) over the chat planner."""
