"""`proxrl serve` + `proxrl train` on models other than the tiny Llama, end to end.

Three architectures of tests/architectures.py, one of each kind that breaks a different part:
Qwen2 (tied embeddings, attention bias), Gemma2 (eager-only, soft-capped attention, a sliding
window every other layer, tied) and Qwen3-MoE (experts). For each, agents chat through the
real openai SDK with answers that cross the window, a real trainer (Ray, FSDP2) trains one step
and publishes it, and then:

- the trainer's proximal logprobs on the claimed tokens equal what the engine reported when it
  sampled them (the step's ``logprob_mismatch_mean``, both under version 0's weights);
- the published directory holds the trained weights (moved from the base), tied models keep
  ``lm_head`` tied to the embeddings;
- a new chat served after the swap has exactly the logprobs of the published weights (a
  float64 forward of the published directory, within 1e-4 nats).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests import architectures
from tests.integration.test_trainer_traffic import Server, finish, metrics, start_trainer
from tests.support import ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOLERANCE = 1e-4  # nats, float32 serving against a float64 forward
BATCH = 4


def chat_logprob_error(server: Server, model_dir) -> tuple[float, list[int]]:
    """One chat after the swap: the largest gap between the logprobs the proxy recorded and a
    float64 forward of ``model_dir``, and the versions of its tokens."""
    session_id, client = server.session(task_id="after")
    client.chat.completions.create(
        model=server.proxy_model,
        messages=[{"role": "user", "content": "Count to ten, slowly, one number a line."}],
        max_tokens=30,
        temperature=1.0,
    )
    turn = server.get(session_id)["turns"][0]
    prompt, completion = turn["prompt_ids"], turn["completion_ids"]
    expected = architectures.reference_logprobs(model_dir, prompt + completion)[len(prompt) - 1 :]
    served = torch.tensor(turn["logprobs"], dtype=torch.float64)
    return (served - expected).abs().max().item(), turn["versions"]


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "qwen3_moe"])
def test_one_step_trains_publishes_and_serves_the_published_weights(name, tiny_model_dir, tmp_path):
    model_dir = architectures.build(name, tmp_path / "model", tiny_model_dir)
    out = tmp_path / "train"
    with ProxyProcess(model_dir, tmp_path / "server") as proxy:
        server = Server(proxy)
        for i in range(BATCH):
            server.episode(reward=float(i % 2), max_tokens=24, temperature=1.0)
        trainer = start_trainer(server, out, f"batch_size={BATCH}", "max_steps=1", "lr=1e-2")
        finish(trainer)
        (step,) = metrics(out)
        assert step["version"] == 1
        print(
            f"{name}: engine vs trainer on the claimed tokens: {step['logprob_mismatch_mean']:.1e}"
        )
        assert step["logprob_mismatch_mean"] < TOLERANCE, step

        # Compared as loaded models: transformers 5 holds MoE experts fused in memory and saves
        # them one by one, as the trainer publishes them.
        published = out / "weights" / "v000001"
        base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        model = AutoModelForCausalLM.from_pretrained(published)
        moved = max((p - base[k]).abs().max().item() for k, p in model.state_dict().items())
        assert moved > 1e-4
        trained = load_file(published / "model.safetensors")
        if name in architectures.TIED:
            assert model.config.tie_word_embeddings
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
            assert "lm_head.weight" not in trained or torch.equal(
                trained["lm_head.weight"], trained["model.embed_tokens.weight"]
            )

        error, versions = chat_logprob_error(server, published)
        assert set(versions) == {1}
        print(f"{name}: served after publish vs float64 of the published weights: {error:.2e}")
        assert error <= TOLERANCE
