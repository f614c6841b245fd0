"""A lean batched decode step for Llama-family decoders (Llama, Qwen2, Qwen3, Mistral).

One decode step of a small model on a CPU is dominated by per-call overhead, not arithmetic:
the Hugging Face modules make ~40 tensor calls per layer through nn.Module dispatch. This step
does the same math in ~20 calls per layer, on fused weights (q|k|v and gate|up each in one
matmul), and writes the same keys and values into the same :class:`SlotKVCache`, so prefill
(through the Hugging Face model) and decode (through this) can be mixed freely. Rotary
embeddings come from the model's own ``rotary_emb`` module, so every RoPE variant it supports
works here too.

Architectures outside the family, or using sliding-window attention, are not supported
(``supports`` says so) and the runner keeps the Hugging Face path for them. The fused weights
are copies: call ``refresh`` after the model's weights change. LoRA adapters apply here as on
the Hugging Face path: the bank's per-row deltas are added to each fused output part by part
(q|k|v, gate|up) and to o and down (``AdapterBank.add_fused``). This module knows nothing about
requests or sampling; the tests compare it with the Hugging Face forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from server.common.architecture import layer_windows
from server.engine.kv_cache import SlotKVCache
from server.engine.lora import AdapterBank

FAMILY = {"llama", "qwen2", "qwen3", "mistral"}


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    qkv_modules: tuple[torch.nn.Module, ...]  # the modules fused, for their LoRA deltas
    o_module: torch.nn.Module
    gate_up_modules: tuple[torch.nn.Module, ...]
    down_module: torch.nn.Module


def supports(model: PreTrainedModel) -> bool:
    config = model.config
    return (
        config.model_type in FAMILY
        and getattr(config, "hidden_act", "silu") == "silu"
        and all(window is None for window in layer_windows(config))
    )


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat(
        [
            linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
            for linear in linears
        ]
    )


class FastDecoder:
    def __init__(self, model: PreTrainedModel, adapters: AdapterBank | None = None) -> None:
        if not supports(model):
            raise ValueError(f"{model.config.model_type} is not a supported Llama-family model")
        config = model.config
        self.model = model
        self.adapters = adapters
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.layers: list[_Layer] = []
        self.refresh()

    @torch.inference_mode()
    def refresh(self) -> None:
        """Rebuild the fused weights from the model's current parameters."""
        layers = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight,
                    qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                    qkv_bias=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                    q_norm=attn.q_norm.weight if hasattr(attn, "q_norm") else None,
                    k_norm=attn.k_norm.weight if hasattr(attn, "k_norm") else None,
                    o=attn.o_proj.weight,
                    o_bias=attn.o_proj.bias,
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj),
                    down=mlp.down_proj.weight,
                    down_bias=mlp.down_proj.bias,
                    qkv_modules=(attn.q_proj, attn.k_proj, attn.v_proj),
                    o_module=attn.o_proj,
                    gate_up_modules=(mlp.gate_proj, mlp.up_proj),
                    down_module=mlp.down_proj,
                )
            )
        self.layers = layers

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As the Hugging Face RMSNorm: normalise in float32, cast back, then scale.
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: SlotKVCache
    ) -> torch.Tensor:
        """Logits [B, V] for slots ``0..B-1``: row b feeds ``tokens[b]`` at ``positions[b]``."""
        rows = tokens.shape[0]
        cache.plan_decode(rows, positions)
        kv_len = cache.get_seq_length()
        visible = torch.arange(kv_len, device=tokens.device) <= positions.unsqueeze(1)
        mask = visible[:, None, None, :]
        x = self.model.model.embed_tokens(tokens)  # [B, hidden]
        cos, sin = self.model.model.rotary_emb(x, positions.unsqueeze(1))  # [B, 1, head_dim]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        slots = torch.arange(rows, device=tokens.device)
        lora = self.adapters if self.adapters is not None and self.adapters.active else None
        for index, layer in enumerate(self.layers):
            h = self._norm(x, layer.input_norm)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            if lora is not None:
                lora.add_fused(h, qkv, layer.qkv_modules, [q_size, kv_size, kv_size])
            q, k, v = qkv.split([q_size, kv_size, kv_size], -1)
            q = q.view(rows, self.num_heads, self.head_dim)
            k = k.view(rows, self.num_kv_heads, self.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            keys, values = cache.keys[index], cache.values[index]
            keys[slots, :, positions] = k
            values[slots, :, positions] = v.view(rows, self.num_kv_heads, self.head_dim)
            attended = F.scaled_dot_product_attention(
                q.unsqueeze(2),
                keys[:rows, :, :kv_len],
                values[:rows, :, :kv_len],
                attn_mask=mask,
                scale=self.head_dim**-0.5,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
            attended = attended.reshape(rows, q_size)
            o = F.linear(attended, layer.o, layer.o_bias)
            if lora is not None:
                lora.add_deltas(layer.o_module, attended, o)
            x = x + o
            h = self._norm(x, layer.post_norm)
            gate_up = F.linear(h, layer.gate_up, layer.gate_up_bias)
            if lora is not None:
                lora.add_fused(h, gate_up, layer.gate_up_modules, [gate_up.shape[-1] // 2] * 2)
            gate, up = gate_up.chunk(2, dim=-1)
            activated = F.silu(gate) * up
            down = F.linear(activated, layer.down, layer.down_bias)
            if lora is not None:
                lora.add_deltas(layer.down_module, activated, down)
            x = x + down
        x = self._norm(x, self.model.model.norm.weight)
        return self.model.lm_head(x)
