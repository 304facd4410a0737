"""Tokenizer loading, chat prompts as token ids, and the EOS id list."""
import json
import shutil

import pytest
from transformers import AutoTokenizer

from jaxrl.hf.tokenizer import (TokenizerError, chat_prompt_ids, detokenizer, eos_token_ids,
                                load_tokenizer)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]


@pytest.fixture(scope="module")
def tok_dir(default_model_dir, tmp_path_factory):
    """The default model's tokenizer files and generation config, without the weights."""
    path = tmp_path_factory.mktemp("tok")
    for f in default_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, path / f.name)
    return path


def test_chat_prompt_ids_equal_transformers_template(tok_dir):
    tok = load_tokenizer(tok_dir)
    ids = chat_prompt_ids(tok, MESSAGES)
    reference = AutoTokenizer.from_pretrained(tok_dir)
    text = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert detokenizer(tok)(ids + [2]) == "system\nBe brief.\nuser\n2 + 2?\nassistant\n"


def test_eos_ids_join_tokenizer_generation_config_and_chat_end_tokens(tok_dir):
    tok = load_tokenizer(tok_dir)
    vocab = tok.get_vocab()
    im_end, endoftext = vocab["<|im_end|>"], vocab["<|endoftext|>"]
    assert tok.eos_token_id == im_end
    assert eos_token_ids(tok, tok_dir) == (im_end, endoftext)  # config's 2 is <|im_end|>
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, im_end]}))
    assert eos_token_ids(tok, tok_dir) == (im_end, 7, endoftext)
    assert eos_token_ids(tok) == (im_end, endoftext)


def test_missing_tokenizer_or_template_is_named(tok_dir, tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(tmp_path)
    tok = load_tokenizer(tok_dir)
    tok.chat_template = None
    with pytest.raises(TokenizerError, match="no chat template"):
        chat_prompt_ids(tok, MESSAGES)
