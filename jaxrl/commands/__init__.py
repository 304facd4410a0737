"""One module per `jaxrl` verb: each has `register(subparsers)`, which adds the verb's parser and
sets `func` (taking the parsed args, returning an exit code). `jaxrl.cli.VERBS` lists them.

`jaxrl --help` imports every verb module to register it, so a verb module imports at its top
only light modules (jaxrl.config and the like) and imports jax and the modules that run the
verb inside the functions that run it: that is why the imports of jaxrl modules in the
command modules are function-local."""
from jaxrl.config import UsageError


def read_input_objects(path: str, text_field: str | None = None) -> list[dict]:
    """The JSON objects of the JSONL file given as --input (blank lines skipped), each with a
    string `text_field` when one is named; an unreadable file or a bad line is a UsageError
    naming it."""
    import json
    from pathlib import Path

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise UsageError(f"--input {path!r} cannot be read: {error.strerror}") from None
    objects = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as error:
            raise UsageError(f"--input {path!r} line {number} is not JSON: {error}") from None
        wanted = "" if text_field is None else f" with a string `{text_field}` field"
        if not isinstance(value, dict) or (
                text_field is not None and not isinstance(value.get(text_field), str)):
            raise UsageError(f"--input {path!r} line {number} must be a JSON object{wanted}")
        objects.append(value)
    return objects

