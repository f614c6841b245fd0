"""``python -m server.cli``: the ``proxrl`` command."""

from server.cli import main

main()
