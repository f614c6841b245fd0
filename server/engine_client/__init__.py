"""The proxy's side of the engines: an HTTP client per engine and a pool that routes to them.

Every engine, SGLang or embedded, is driven through SGLang's native HTTP API
(docs/architecture/sglang-protocol.md); nothing here imports torch.
"""
