"""The embedded engine: a real CPU/GPU inference server (torch + transformers) behind SGLang's
native HTTP API, run as its own process (``proxrl engine``).

Owns: the routes (``app``), request schemas and SGLang's error shapes (``protocol``), the
scheduler with continuous batching, pause/abort and weight swaps, the model runner, KV cache,
sampling with exact logprobs and SGLang's output shapes.

Does not know: the proxy, the store or the trainer. It imports only ``server.text`` and
``server.common`` of the rest of the project.
"""
