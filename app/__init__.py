"""Command line, configuration, the HTTP API and server wiring."""
