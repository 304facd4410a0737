"""What crosses the mesh, read from the compiled programs (jaxrl/hlo.py) of a tiny bf16 NF4
model on meshes (1, 8, 1) and (1, 1, 8) of 8 fake CPU devices: the decode chunk and the GRPO
step move no dequantized weight and no full-vocabulary float32 logits; with FSDP the step
gathers each layer's NF4 codes instead of all-reducing its activations; with tensor splits
the activations it all-reduces carry bfloat16. Compiled only, nothing runs (tools/collectives.py
lists the same for Qwen3-4B)."""
import functools
import math
import re

import pytest

from jaxrl.planner import abstract_run, lower_sampler, lower_step
from jaxrl.config import load_config
from jaxrl.hlo import CPU_OPTIONS, Program, forbidden
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.params import declare
from jaxrl.sharding import MeshRules, make_mesh

# vocab and sequence sizes apart from every weight dim, so a logits array is told by its shape;
# a vocab above the sampler's 256 candidates per part times 8 parts, so that their exchange is
# smaller than the logits, as in any real vocab
SPEC = spec_from_hf_config({
    "model_type": "qwen3", "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "eos_token_id": 2})
ROWS, GROUP, PROMPT, NEW = 8, 2, 16, 8  # the step's rows, G, the prompt bucket, new tokens
# hidden states [rows, tokens, ...] in the step: a group's prompt once, each row's completion
STEP_ACTIVATIONS = {(ROWS // GROUP, PROMPT), (ROWS, NEW)}
KERNELS = {d.shape[1:] for p, d in declare(SPEC).items()
           if p.startswith("layers/") and p.endswith("/kernel")}
MESHES = {"fsdp": (1, 8, 1), "tensor": (1, 1, 8)}


@functools.lru_cache(maxsize=None)
def _programs(mesh: str) -> dict[str, Program]:
    data, fsdp, tensor = MESHES[mesh]
    cfg = load_config(None, [
        "model.dtype=bfloat16", "quant.mode=nf4", "quant.block_size=16", "quant.double_quant=true",
        "quant.dequantize=per_layer", "lora.rank=4", "data.prompts_per_step=4",
        f"grpo.num_generations={GROUP}", f"data.max_prompt_tokens={PROMPT}",
        f"sampling.max_new_tokens={NEW}",
        f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}"])
    rules = MeshRules(make_mesh(cfg.mesh))
    run = abstract_run(cfg, SPEC, rules)
    lowered = {"decode": lower_sampler(cfg, SPEC, rules, run),
               "step": lower_step(cfg, SPEC, rules, run, "full")}
    return {name: Program(program.compile(CPU_OPTIONS).as_text())
            for name, program in lowered.items()}


def _arrays(move):
    """(dtype, shape) of each array a collective's result carries."""
    return [(d, tuple(int(n) for n in dims.split(",") if n))
            for d, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", move.result_type)]


def _activations(moves, kind: str):
    """The arrays of `kind` collectives shaped like the layers' hidden states or larger per
    token: STEP_ACTIVATIONS with at least the hidden size per token (not LoRA's rank). The LM
    head's own (its input gradient, [ROWS, NEW, E] too, summed over the vocab split in the
    head's float32) are not the layers'."""
    return [(d, shape) for m in moves if m.opcode.removesuffix("-start") == kind
            and not re.search(r"e,[ev]{2}->\.\.\.v", m.op_name)
            for d, shape in _arrays(m) if shape[:2] in STEP_ACTIVATIONS
            and d in ("bf16", "f32") and math.prod(shape[2:]) >= SPEC.hidden_size]


@pytest.mark.slow  # compiles two programs on each mesh
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("program", ["decode", "step"])
def test_no_dequantized_weight_or_float32_logits_crosses_the_mesh(mesh, program):
    moves = _programs(mesh)[program].collectives(every_branch=True)
    assert moves  # the mesh splits the work, so something crosses it
    bad = [(m.opcode, why, m.op_name) for m in moves
           if (why := forbidden(m.result_type, SPEC.vocab_size, KERNELS))]
    assert not bad


@pytest.mark.slow
def test_fsdp_step_gathers_nf4_codes_not_activations():
    moves = _programs("fsdp")["step"].collectives()
    assert not _activations(moves, "all-reduce")
    gathered = {d for m in moves if m.opcode.startswith("all-gather") for d, _ in _arrays(m)}
    assert "u8" in gathered  # the NF4 codes, as stored


@pytest.mark.slow
def test_tensor_step_reduces_activations_in_bfloat16():
    moves = _programs("tensor")["step"].collectives()
    reduced = _activations(moves, "all-reduce")
    assert reduced  # o_proj and down_proj outputs, and the input gradients
    assert {d for d, _ in reduced} == {"bf16"}


def test_the_float_type_a_collective_carries_is_read_through_xla_cpus_widening():
    """XLA:CPU converts a bfloat16 operand to float32 just before the collective; the move
    counts as the bfloat16 it carries, a float32 value computed as such stays float32."""
    program = Program(HLO)
    (widened, plain) = program.collectives()
    assert widened.result_type == "bf16[16,32]{1,0}" and widened.bytes == 16 * 32 * 2
    assert plain.result_type == "f32[16,32]{1,0}" and plain.bytes == 16 * 32 * 4


HLO = """HloModule m, entry_computation_layout={(f32[2,32]{1,0})->(f32[16,32]{1,0})}

%wrapped_convert_computation (p0: f32[2,32]) -> f32[2,32] {
  %p0 = f32[2,32]{1,0} parameter(0)
  %convert.1 = bf16[2,32]{1,0} convert(%p0)
  ROOT %convert.2 = f32[2,32]{1,0} convert(%convert.1)
}

ENTRY %main (param: f32[2,32]) -> (f32[16,32], f32[16,32]) {
  %param = f32[2,32]{1,0} parameter(0)
  %rounded = f32[2,32]{1,0} fusion(%param), kind=kLoop, calls=%wrapped_convert_computation
  %all-gather = f32[16,32]{1,0} all-gather(%rounded), dimensions={0}
  %all-gather.1 = f32[16,32]{1,0} all-gather(%param), dimensions={0}
  ROOT %t = (f32[16,32]{1,0}, f32[16,32]{1,0}) tuple(%all-gather, %all-gather.1)
}
"""
