"""API keys: the keys a gateway knows (key_store), the scopes a route may need (scopes), per-key
limits (key_limits), and the middleware that checks all three before a route runs (api_keys)."""
