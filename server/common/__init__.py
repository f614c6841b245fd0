"""What the server's processes and the trainer share, and nothing else: starting, waiting for
and stopping child server processes (``processes``), building the tiny model offline
(``tiny_model``, its ``chat_template.jinja``), what a model config says of its attention
(``architecture``), how weights travel from a trainer to the engines (``weight_transfer``:
checkpoints on disk, the named broadcast group), the admin-key rule (``admin_keys``), the keyword a
model takes its KV cache by (``cache_argument``) and the progress bar of long commands
(``progress``).

The trainer imports the server only through this package. Nothing here imports any other
part of the server; modules that need torch import it themselves, so importing the package
loads nothing heavy.
"""
