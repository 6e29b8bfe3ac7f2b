"""The OpenAI/DeepSeek-compatible API: request bodies, routes, the engine requests behind them."""
