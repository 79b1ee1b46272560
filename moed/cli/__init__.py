"""moectl verbs, one module per group; each exposes `register(subparsers)`."""
