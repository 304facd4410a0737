"""Several PEFT adapters served beside the base, each under its own model id: /v1/models lists
them, and each model's replies equal the engine's with that adapter, also when requests for
all of them arrive together (they decode in turn)."""
import threading

import pytest
import torch

from jaxrl.hf.peft_io import load_peft_adapter
from jaxrl.sampling import Decoding, Engine, Request
from jaxrl.serve import start_server
from tests.serve.helpers import HELLO, SERVE, client, post
from tests.tiny_models import make_model


def _adapter(path, seed, targets=("q_proj", "v_proj")):
    from peft import LoraConfig, get_peft_model

    base = make_model("llama", vocab_size=49152)
    torch.manual_seed(seed)  # after make_model, which seeds torch itself
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            target_modules=list(targets)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(4.0)  # large enough to change the greedy tokens
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(tiny_chat_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    spec = tiny_chat_model.spec
    adapters = {"step-10": load_peft_adapter(_adapter(root / "a", 1), spec),
                "step-20": load_peft_adapter(_adapter(root / "b", 2), spec)}
    with start_server(tiny_chat_model, port=0, adapters=adapters, **SERVE) as handle:
        yield handle, adapters


def _reference(model, lora):
    """The greedy reply of the engine (shaped as the server's) with `lora`."""
    engine = Engine(model.params, model.spec, eos_ids=model.eos_ids, slots=SERVE["slots"],
                    capacity=SERVE["max_model_len"], chunk=SERVE["chunk"], lora=lora)
    request = engine.submit(Request(model.chat_ids(HELLO), Decoding(0.0), 10))
    engine.run()
    return model.detokenize(request.tokens)


def test_each_adapter_is_its_own_model(served, tiny_chat_model):
    handle, adapters = served
    c = client(handle)
    assert [m.id for m in c.models.list().data] == [handle.model_id, "step-10", "step-20"]
    assert c.models.retrieve("step-20").parent == handle.model_id
    want = {handle.model_id: _reference(tiny_chat_model, None),
            **{name: _reference(tiny_chat_model, lora) for name, lora in adapters.items()}}
    assert len(set(want.values())) == 3  # the adapters change the replies
    got, threads = {}, []

    def ask(model, i):
        got[model, i] = c.chat.completions.create(model=model, messages=HELLO, temperature=0,
                                                  max_tokens=10).choices[0].message.content

    for i in range(2):
        threads += [threading.Thread(target=ask, args=(m, i)) for m in want]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {(m, i): text for m, text in want.items() for i in range(2)}
    assert handle.counts.switches >= 2
    status, body = post(handle, "/chat/completions", {"model": "step-30", "messages": HELLO})
    assert status == 404 and "step-10" in body["error"]["message"]
