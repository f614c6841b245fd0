"""The engine computes the checkpoint's model, for every architecture in tests/architectures.py.

Each model is served by the real :class:`EngineService` (scheduler, slot KV cache, sampler),
float32 on the CPU. Four requests of different prompt lengths run together, each long enough
to cross the sliding window several times, and finish at different steps (so slots move while
others decode). The logprob the engine reports for every sampled token must equal a float64
teacher-forced forward of the same model on prompt + output, with the model's own attention
and masks (``tests.architectures.reference_logprobs``), within ``TOLERANCE``.

Tolerance 1e-4 nats: float32 against float64 on logprobs of magnitude ~5-9. Measured max diffs
per architecture are printed by the test (0.9e-6 to 2.0e-6 on this machine's CPU). The same
requests through the masks of the old engine (a boolean mask, which eager attention adds to its
scores instead of masking, and no sliding windows) were off by 2.14 (mistral), 1.46 (gemma2),
2.36 (gemma3) and 3.03 (phi3) nats; ``test_the_matrix_would_catch_a_missing_window`` keeps
that sensitivity checked.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from server.common.architecture import UnsupportedModel, layer_windows
from server.engine import protocol
from server.engine.runner import ModelRunner, RunnerConfig
from server.engine.service import EngineService
from server.engine.settings import EngineSettings
from tests import architectures

TOLERANCE = 1e-4
PROMPTS = (3, 11, 20, 6)  # prompt lengths
NEW_TOKENS = (30, 18, 25, 12)  # finish at different steps


async def _generate_together(service: EngineService, prompts: list[list[int]]) -> list[dict]:
    async def one(ids: list[int], new_tokens: int) -> dict:
        request = protocol.GenerateRequestIn(
            input_ids=ids,
            sampling_params={"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True},
            return_logprob=True,
        )
        items, _ = service.parse(request)
        return (await service.generate(request, items))[0]

    return await asyncio.gather(*(one(ids, n) for ids, n in zip(prompts, NEW_TOKENS, strict=True)))


def serve_together(
    model_dir: str, seed: int = 0, device: str = "cpu", dtype: str = "float32"
) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """Four concurrent requests through a real EngineService: (prompt, output ids, logprobs)."""
    service = EngineService(EngineSettings(model=model_dir, device=device, dtype=dtype, seed=seed))
    service.scheduler.start()
    try:
        generator = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(3, 680, (n,), generator=generator).tolist() for n in PROMPTS]
        outputs = asyncio.run(_generate_together(service, prompts))
    finally:
        service.close()
    served = []
    for prompt, output, new_tokens in zip(prompts, outputs, NEW_TOKENS, strict=True):
        entries = output["meta_info"]["output_token_logprobs"]
        assert len(entries) == new_tokens
        logprobs = torch.tensor([entry[0] for entry in entries], dtype=torch.float64)
        served.append((prompt, [entry[1] for entry in entries], logprobs))
    return served


def served_logprob_error(model_dir: str, seed: int = 0) -> float:
    """Largest |engine logprob - float64 reference| over four concurrent requests."""
    worst = 0.0
    for prompt, tokens, logprobs in serve_together(model_dir, seed):
        expected = architectures.reference_logprobs(model_dir, prompt + tokens)[len(prompt) - 1 :]
        worst = max(worst, (logprobs - expected).abs().max().item())
    return worst


@pytest.mark.parametrize("name", list(architectures.ARCHITECTURES))
def test_served_logprobs_equal_the_checkpoints_model(name, model_dirs):
    error = served_logprob_error(model_dirs[name])
    print(f"{name}: max |served - float64 reference| = {error:.2e}")
    assert error <= TOLERANCE


def test_sequences_cross_the_windows(model_dirs):
    """The matrix means something only if its sequences are longer than the windows."""
    for name in architectures.WINDOWED:
        config = ModelRunner(RunnerConfig(model_dirs[name], max_slots=1)).model.config
        window = max(w for w in layer_windows(config) if w is not None)
        assert min(p + n for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)) > 2 * window


def test_the_matrix_would_catch_a_missing_window(model_dirs, monkeypatch):
    """With the windows dropped from the engine's masks, windowed models serve other logprobs."""
    original = ModelRunner.__init__

    def without_windows(self, config):
        original(self, config)
        self.windows = [None] * len(self.windows)
        self.mask_mapping = False

    monkeypatch.setattr(ModelRunner, "__init__", without_windows)
    for name in ("mistral", "gemma2"):
        assert served_logprob_error(model_dirs[name]) > 0.1


def test_an_attention_feature_the_engine_cannot_compute_is_refused(model_dirs, tmp_path):
    """A chunked-attention model (Llama 4's local layers) is refused at start, by name."""
    import json
    import shutil

    directory = tmp_path / "chunked"
    shutil.copytree(model_dirs["llama"], directory)
    config = json.loads((directory / "config.json").read_text())
    config["attention_chunk_size"] = 8
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="attention_chunk_size"):
        ModelRunner(RunnerConfig(str(directory), max_slots=1))


@pytest.mark.parametrize("name", ["gpt_neox", "qwen3_moe", "qwen2"])
def test_weights_under_checkpoint_names_load_into_the_engine(name, model_dirs, tmp_path):
    """What a trainer publishes (the checkpoint format's names: GPT-NeoX's ``embed_out``, a MoE
    layer's experts one by one) loads into the engine as ``from_pretrained`` would load it;
    the trainer's ``checkpoint_names`` gives exactly the names ``save_pretrained`` writes."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from server.common.weight_transfer import read_checkpoint
    from trainer.model import checkpoint_names

    changed = AutoModelForCausalLM.from_pretrained(model_dirs[name])
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in changed.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    changed.save_pretrained(tmp_path / "changed")
    with safe_open(str(tmp_path / "changed" / "model.safetensors"), "pt") as saved:
        saved_names = set(saved.keys())
    state = {
        k: v
        for k, v in changed.state_dict().items()
        if not (name in architectures.TIED and k == "lm_head.weight")
    }
    assert set(checkpoint_names(changed, state)) == saved_names

    runner = ModelRunner(RunnerConfig(model_dirs[name], max_slots=1, fast_decode=False))
    runner.load_weights(runner.model_named(read_checkpoint(tmp_path / "changed")))
    ids = list(range(10, 40))
    with torch.inference_mode():
        expected = changed(torch.tensor([ids])).logits[0]
        chunks: list[torch.Tensor] = []
        runner.prefill(0, ids, on_logits=lambda _start, logits: chunks.append(logits))
        served = torch.cat(chunks)
    assert (served - expected).abs().max().item() < TOLERANCE


def test_names_the_engine_cannot_map_are_refused_as_bad_input(model_dirs):
    """A stacked expert tensor given only one of its experts, or a name no checkpoint of the
    model has: a ValueError (the engine's {"success": false}), not an error of another kind."""
    runner = ModelRunner(RunnerConfig(model_dirs["qwen3_moe"], max_slots=1))
    one_expert = {"model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(64, 32)}
    with pytest.raises(ValueError, match="cannot map"):
        runner.model_named(one_expert)
    with pytest.raises(ValueError, match="unknown parameter names"):
        runner.model_named({"model.layers.0.mlp.nonsense.weight": torch.zeros(2)})
