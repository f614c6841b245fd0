"""Pure text handling, shared by the proxy and the embedded engine: a model's tokenizer and
chat template (``tokenization``), decoding a growing token sequence a delta at a time
(``detokenize``), and stop strings in streamed text (``stop_strings``).

Knows neither HTTP nor the store nor torch; imports nothing else of the server.
"""
