"""Several PEFT adapters served beside the base, each under its own model id: /v1/models lists
them, and requests for all of them arriving together decode in one batch, rows of different
adapters in the same engine steps (counted in /metrics), each reply equal to the engine's
with that adapter alone."""
import re
import threading
import time

import pytest
import torch

import jaxrl.serve.server
from jaxrl.hf.peft_io import load_peft_adapter
from jaxrl.sampling import Decoding, Engine, Request
from jaxrl.serve import start_server
from tests.serve.helpers import HELLO, SERVE, client, get, post


class _Gated(Engine):
    """The server's engine, whose steps wait while `gate` is clear: requests pile up."""

    gate = threading.Event()

    def step(self):
        assert self.gate.wait(120)
        return super().step()
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
    _Gated.gate.set()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jaxrl.serve.server, "Engine", _Gated)
        with start_server(tiny_chat_model, port=0, adapters=adapters, **SERVE) as handle:
            yield handle, adapters


def _reference(model, lora):
    """The greedy reply of the engine (shaped as the server's) with `lora`."""
    engine = Engine(model.params, model.spec, eos_ids=model.eos_ids, slots=SERVE["slots"],
                    capacity=SERVE["max_model_len"], chunk=SERVE["chunk"], lora=lora)
    request = engine.submit(Request(model.chat_ids(HELLO), Decoding(0.0), 10))
    engine.run()
    assert len(request.tokens) == 10  # no early EOS: a first request outlives the first chunk
    return model.detokenize(request.tokens)


def _metric(text, name, model=None):
    label = "" if model is None else re.escape(f'{{model="{model}"}}')
    found = re.search(rf"^{name}{label} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} {model} not in /metrics"
    return float(found.group(1))


def test_each_adapter_is_its_own_model(served):
    handle, _ = served
    c = client(handle)
    assert [m.id for m in c.models.list().data] == [handle.model_id, "step-10", "step-20"]
    assert c.models.retrieve("step-20").parent == handle.model_id
    status, body = post(handle, "/chat/completions", {"model": "step-30", "messages": HELLO})
    assert status == 404 and "step-10" in body["error"]["message"]


def test_models_decode_together_as_each_alone(served, tiny_chat_model):
    handle, adapters = served
    c = client(handle)
    want = {handle.model_id: _reference(tiny_chat_model, None),
            **{name: _reference(tiny_chat_model, lora) for name, lora in adapters.items()}}
    assert len(set(want.values())) == 3  # the adapters change the replies
    got, threads = {}, []

    def ask(model, i):
        got[model, i] = c.chat.completions.create(model=model, messages=HELLO, temperature=0,
                                                  max_tokens=10).choices[0].message.content

    for i in range(2):
        threads += [threading.Thread(target=ask, args=(m, i)) for m in want]
    # the engine's first step waits until all six requests are in: the first decodes alone for
    # a chunk, then three more join its batch (4 slots), of at least two models
    _Gated.gate.clear()
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while handle.counts.running + handle.counts.waiting < len(threads):
            assert time.monotonic() < deadline, handle.counts
            time.sleep(0.01)
    finally:
        _Gated.gate.set()
    for t in threads:
        t.join(120)
    assert got == {(m, i): text for m, text in want.items() for i in range(2)}
    counts = handle.counts
    assert counts.mixed_steps > 0
    assert all(counts.model_tokens[m] > 0 and counts.model_steps[m] > 0 for m in want)
    text = get(handle, "/metrics")
    assert _metric(text, "jaxrl_serve_engine_mixed_adapter_steps_total") > 0
    for m in want:
        assert _metric(text, "jaxrl_serve_engine_adapter_tokens_total", m) > 0
        assert _metric(text, "jaxrl_serve_engine_adapter_steps_total", m) > 0
