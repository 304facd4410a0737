"""Low-rank adapters: a pytree separate from the frozen base weights."""
