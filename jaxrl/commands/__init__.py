"""One module per `jaxrl` verb: each has `register(subparsers)`, which adds the verb's parser and
sets `func` (taking the parsed args, returning an exit code). `jaxrl.cli.VERBS` lists them."""
