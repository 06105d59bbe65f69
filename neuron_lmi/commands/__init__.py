"""One module per ``neuron-lmi`` subcommand; each exposes ``add_parser(subparsers)``."""
