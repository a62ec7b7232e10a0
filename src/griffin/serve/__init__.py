"""``griffin serve``: an OpenAI-compatible server with continuous batching and prefix-state caching (Section 5)."""
