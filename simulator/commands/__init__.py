"""Subcommands of the ``daopsim`` CLI, one module per command group."""
