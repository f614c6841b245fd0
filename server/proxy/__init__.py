"""The agent-facing proxy: every OpenAI-compatible route and everything on its request path.

Owns: the routes under ``/v1`` and ``/sessions/{id}/v1`` (``routes``), their request schemas,
rendering a conversation to prompt ids (``chat``, ``completions``, ``prompts``), one
completion through the engines (``generation``), streaming and its errors (``streaming``),
tool calls in model text, what a completion returns (``outputs``), what the proxy remembers
of each session between turns (``session_cache``) and recording turns (``recording``).

Does not know: how runs, sessions, rewards and claims are managed over REST (``server.rl``),
SQL (it calls ``server.store``), or how an engine samples (it speaks SGLang's protocol
through ``server.engine_client``). Imports neither torch nor ray.
"""
