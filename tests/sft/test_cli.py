"""`jaxrl sft` end to end on a tiny llama: the loss falls, a stopped run
resumes where its checkpoint left off, and the exported adapter loads in PEFT."""
import copy
import json

import numpy as np

from jaxrl.cli import main
from jaxrl.hf.peft_io import load_peft_adapter
from jaxrl.model.families import load_spec

CHATS = [[{"role": "user", "content": f"What is {a} + {b}?"},
          {"role": "assistant", "content": f"<think>{a} plus {b}.</think> {a + b}"}]
         for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1)]]


def _run(path, data, out, steps, capsys):
    assert main(["sft", f"model.path={path}", f"data.train_file={data}", f"run.steps={steps}",
                 f"run.output_dir={out}", "quant.mode=none", "sft.batch_size=4",
                 "optim.micro_batch_size=2", "optim.lr=0.05", "lora.rank=4", "lora.alpha=8",
                 "lora.targets=q_proj,v_proj", "checkpoint.every=4"]) == 0
    return capsys.readouterr()


def test_loss_falls_run_resumes_and_adapter_loads_in_peft(tiny_chat, tmp_path, capsys):
    from peft import PeftModel

    path, torch_model = tiny_chat
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    out = tmp_path / "run"
    _run(path, data, out, 8, capsys)
    resumed = _run(path, data, out, 12, capsys)
    assert "resuming from" in resumed.err and "(step 8)" in resumed.err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    losses = [r["loss/train"] for r in rows]
    assert np.mean(losses[-3:]) < losses[0] - 2.5, losses  # measured: 11.58 to 8.23
    assert all(r["train/skipped"] == 0 for r in rows)
    assert (out / "config.yaml").is_file() and (out / "report.png").is_file()
    # PEFT injects its layers into the model it is given: give it a copy of the shared one
    peft = PeftModel.from_pretrained(copy.deepcopy(torch_model), out / "adapter")
    ours = load_peft_adapter(out / "adapter", load_spec(path))
    a = peft.base_model.model.model.layers[1].self_attn.v_proj.lora_A["default"].weight
    np.testing.assert_allclose(a.detach().numpy().T, ours.weights["layers"]["v_proj"]["a"][1])
    assert float(np.abs(ours.weights["layers"]["v_proj"]["b"]).max()) > 0  # it was trained
