"""An OpenAI-compatible HTTP server over the decode engine (`jaxrl serve`), also startable in
process: `start_server(load_pretrained(path), port=0)` returns a handle with `.url` (the base
URL for an OpenAI client), `.model_id`, `.models` and `.close()`."""
from jaxrl.serve.server import ServeOptions, ServerHandle, start_server

__all__ = ["ServeOptions", "ServerHandle", "start_server"]
