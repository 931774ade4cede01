"""Client tools: commands that look at a deployment from outside rather than serve it, such as
`kvfence probe` (a black-box isolation prober of any OpenAI-compatible endpoint) and
`kvfence status` (the operator's view of a deployment's workers)."""
