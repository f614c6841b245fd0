"""The architecture matrix on CUDA (skipped without it).

float32: the engine on CUDA serves the float64 reference's logprobs within 1e-4 nats, as on
the CPU. bfloat16 (what a GPU run serves and trains in): the engine's logprobs against the
trainer's packed forward of the same tokens, both in bfloat16 on CUDA, reported per
architecture. bfloat16 keeps 8 bits of mantissa, so two different kernels (batched decode
against one packed forward) disagree per token: on the CPU in bfloat16 the same comparison
gave means of 0.9e-3 to 3.1e-3 nats and maxima up to 1.6e-2 (llama, mistral, gpt_neox). The
bound below (a mean of 0.05 nats) catches a wrong model (a dropped window or soft-cap costs
1-3 nats); the test prints the CUDA figures.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests import architectures
from tests.unit.test_architectures_engine import serve_together
from trainer import attention
from trainer.batching import packed, shift_logprobs

pytestmark = pytest.mark.gpu

FLOAT32_TOLERANCE = 1e-4
BFLOAT16_MEAN_BOUND = 0.05


@pytest.mark.parametrize("name", list(architectures.ARCHITECTURES))
def test_float32_on_cuda_serves_the_reference(name, model_dirs):
    worst = 0.0
    for prompt, tokens, logprobs in serve_together(model_dirs[name], device="cuda"):
        expected = architectures.reference_logprobs(model_dirs[name], prompt + tokens)
        worst = max(worst, (logprobs - expected[len(prompt) - 1 :]).abs().max().item())
    print(f"{name}: float32 CUDA engine vs float64 reference: max {worst:.2e}")
    assert worst <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("name", list(architectures.ARCHITECTURES))
def test_bfloat16_engine_and_trainer_agree(name, model_dirs):
    served = serve_together(model_dirs[name], device="cuda", dtype="bfloat16")
    attention.register()
    model = AutoModelForCausalLM.from_pretrained(
        model_dirs[name], dtype=torch.bfloat16, attn_implementation=attention.NAME
    )
    model = model.to("cuda").eval()
    rows = [prompt + tokens for prompt, tokens, _ in served]
    batch = packed(rows)
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids.cuda(),
            position_ids=batch.position_ids.cuda(),
            cu_seq_lens_q=batch.cu_seqlens.cuda(),
            use_cache=False,
        ).logits[0]
        trainer = shift_logprobs(logits.float(), batch.input_ids[0].cuda(), batch.cu_seqlens.cuda())
    gaps = []
    for (prompt, tokens, logprobs), start in zip(served, batch.cu_seqlens.tolist(), strict=False):
        mine = trainer[start + len(prompt) : start + len(prompt) + len(tokens)].double().cpu()
        gaps.append((logprobs - mine).abs())
    gap = torch.cat(gaps)
    print(f"{name}: bfloat16 engine vs trainer: mean {gap.mean():.2e}, max {gap.max():.2e}")
    assert gap.mean().item() < BFLOAT16_MEAN_BOUND
