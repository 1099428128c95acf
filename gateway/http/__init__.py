"""The HTTP side of the gateway: the app, its hardening middlewares, body parsing, API keys and the errors."""
