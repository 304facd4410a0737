"""One module per `jaxrl` verb: each has `register(subparsers)`, which adds the verb's parser and
sets `func` (taking the parsed args, returning an exit code). `jaxrl.cli.VERBS` lists them."""


class UsageError(ValueError):
    """Bad command-line usage; `jaxrl` exits 2. (Defined here, not in jaxrl.cli, so that
    `python -m jaxrl.cli` and the installed command raise and catch the same class.)"""
