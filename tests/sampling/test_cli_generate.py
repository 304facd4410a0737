"""`jaxrl generate` on a tiny random llama that carries the default model's tokenizer (so the
chat template and EOS ids are real), with and without a PEFT adapter."""

import torch

from jaxrl.cli import main
from tests.tiny_models import make_model


def _hf_greedy_text(model, model_dir, prompt, n):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=[2, 0], pad_token_id=2)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_greedy_prints_what_transformers_generates(tiny_chat, capsys):
    path, model = tiny_chat
    assert main(["generate", "--model", str(path), "--prompt", "Hi there", "--max-new-tokens",
                 "12"]) == 0
    captured = capsys.readouterr()
    assert captured.out == _hf_greedy_text(model, path, "Hi there", 12) + "\n"
    assert len(captured.out.split()) > 3
    assert "1 completion(s)" in captured.err


def test_n_completions_with_an_adapter(tiny_chat, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    path, model = tiny_chat
    get_peft_model(make_model("llama", vocab_size=49152),
                   LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                              init_lora_weights=False)).save_pretrained(tmp_path / "adapter")
    args = ["generate", "--model", str(path), "--prompt", "Hi", "--n", "3", "--temperature",
            "0.8", "--max-new-tokens", "6", "--seed", "1"]
    assert main(args + ["--adapter", str(tmp_path / "adapter")]) == 0
    out = capsys.readouterr().out
    assert [line.startswith("=== completion ") for line in out.splitlines()].count(True) == 3
    assert main(args + ["--adapter", str(tmp_path / "adapter")]) == 0
    assert capsys.readouterr().out == out  # the same seed gives the same completions


def test_bad_flags_and_adapter_exit_2_naming_them(tiny_chat, tmp_path, capsys):
    path, _ = tiny_chat
    base = ["generate", "--model", str(path), "--prompt", "Hi"]
    assert main(base + ["--top-p", "0"]) == 2
    assert "--top-p must be > 0" in capsys.readouterr().err
    assert main(base + ["--adapter", str(tmp_path)]) == 2
    assert "adapter_config.json" in capsys.readouterr().err
