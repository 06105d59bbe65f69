"""Which backend serves a model on this host (``dispatch``) and each backend's own argument mapping."""
