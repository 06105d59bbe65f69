"""One module per ``neuron-lmi`` subcommand; each exposes ``add_parser(subparsers)``.

Every command module is imported to build the parser (``cli.build_parser``), so each imports its
backends, torch and the engine inside its ``run``: ``neuron-lmi --help``, ``plan`` and ``cache`` start
without loading torch or a Neuron library. That is the stated reason for the function-local imports
in this package; the layers below import at module level.
"""
