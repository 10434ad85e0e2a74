"""The session endpoint: an OpenAI-compatible server whose calls become token-exact training episodes."""
