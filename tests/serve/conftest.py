"""A tiny random llama with the default model's tokenizer and chat template (real EOS ids),
loaded once per module, and a server over it."""
import shutil

import pytest

from tests.tiny_models import make_model


@pytest.fixture(scope="module")
def tiny_chat_model(default_model_dir, tmp_path_factory):
    from jaxrl.hf.pretrained import load_pretrained

    path = tmp_path_factory.mktemp("serve-chat")
    make_model("llama", vocab_size=49152).save_pretrained(path)
    for f in default_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, path / f.name)
    return load_pretrained(path)
