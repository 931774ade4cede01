"""The OpenAI-compatible HTTP API: its routes (routes.py, token_routes.py) over an `EngineClient`,
the wire schemas of requests and responses and the checks a body must pass, the edge ahead of every
route (hosts, API keys, body limits), the responses of admitted requests, and what the front end
does for structured output and tool calls before a request reaches the scheduler."""
