"""The application: the `kvfence` command (cli.py) and its parts, lowest first: configuration (config/),
the OpenAI-compatible HTTP API (api/), a deployment in one process (serve/), workers in processes of
their own and the front end that drives them (remote/), and client tools (tools/)."""
