"""A tiny random llama with the default model's tokenizer and chat template (real EOS ids),
loaded once per module."""
import pytest


@pytest.fixture(scope="module")
def tiny_chat_model(tiny_chat):
    from jaxrl.hf.pretrained import load_pretrained

    return load_pretrained(tiny_chat[0])
