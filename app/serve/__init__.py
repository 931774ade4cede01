"""Assembling a deployment in one process (`kvfence serve` without --discovery): the workers built
from the config and sized against the context, their transport endpoints paired, the readiness
canary, the isolation guards, and the server that runs it all under the HTTP front end."""
