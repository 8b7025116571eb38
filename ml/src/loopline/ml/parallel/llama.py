"""A Llama decoder whose linear layers are megatron-core's tensor-parallel ones.

Per rank, at TP size t: q/k/v and gate/up are ColumnParallelLinear (the rank computes its own
heads and its own slice of the MLP width), o/down are RowParallelLinear (partial sums, all-reduced
back to the full hidden state), the embedding is a VocabParallelEmbedding and the LM head a
ColumnParallelLinear over the vocabulary whose logits stay split, for vocab_parallel_cross_entropy.
The residual stream, the norms and the rotary tables are whole and identical on every rank.

Parameter names are the HF checkpoint's (``model.layers.0.self_attn.q_proj.weight``, ...), so
loading and saving walk named_parameters() with no renaming. Weights are allocated on the CPU and
left uninitialised (``use_cpu_initialization``, ``perform_initialization=False``): megatron's own
initialisation goes through its CUDA RNG tracker, and every value is loaded from HF anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mcore import (
    ColumnParallelLinear,
    ModelParallelConfig,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_state,
)
from .sharding import Shard, padded_vocab

SUPPORTED_MODEL_TYPES = ("llama",)


def _no_init(_tensor: torch.Tensor) -> None:
    """Never called (perform_initialization=False); the layers require an init_method argument."""


def layer_kwargs(tp: int, dtype: torch.dtype, group) -> dict:
    """The keyword arguments every megatron layer of the model gets."""
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
        sequence_parallel=False,
        gradient_accumulation_fusion=False,  # needs Apex's CUDA extension
    )
    return {"config": config, "init_method": _no_init, "tp_group": group}


class RMSNorm(nn.Module):
    """As HF computes it: normalise in float32, cast back, then scale."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Heads:
    """How the attention heads fall on the ranks (checked once, used by the layers and the loader)."""

    def __init__(self, config, tp: int):
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        if heads % tp:
            raise ValueError(f"{heads} attention heads do not divide by tensor_parallel={tp}")
        if kv % tp and tp % kv:
            raise ValueError(f"{kv} KV heads and tensor_parallel={tp}: one must divide the other")
        # Fewer KV heads than ranks: each rank keeps a copy of the one KV head its queries use.
        self.kv_repeat = tp // kv if kv < tp else 1
        self.q_local = heads // tp
        self.kv_local = kv * self.kv_repeat // tp
        self.q_per_kv = self.q_local // self.kv_local


class ParallelAttention(nn.Module):
    def __init__(self, config, heads: Heads, mega: dict):
        super().__init__()
        self.heads = heads
        hd, bias = heads.head_dim, config.attention_bias
        q_size = config.num_attention_heads * hd
        kv_size = config.num_key_value_heads * heads.kv_repeat * hd
        column = dict(mega, bias=bias, gather_output=False)
        self.q_proj = ColumnParallelLinear(config.hidden_size, q_size, **column)
        self.k_proj = ColumnParallelLinear(config.hidden_size, kv_size, **column)
        self.v_proj = ColumnParallelLinear(config.hidden_size, kv_size, **column)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, **mega, bias=bias, input_is_parallel=True,
                                        skip_bias_add=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        h = self.heads
        q = self.q_proj(x)[0].view(b, s, h.q_local, h.head_dim).transpose(1, 2)
        k = self.k_proj(x)[0].view(b, s, h.kv_local, h.head_dim).transpose(1, 2)
        v = self.v_proj(x)[0].view(b, s, h.kv_local, h.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k = k.repeat_interleave(h.q_per_kv, dim=1)
        v = v.repeat_interleave(h.q_per_kv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=h.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, h.q_local * h.head_dim))[0]


class ParallelMLP(nn.Module):
    def __init__(self, config, mega: dict):
        super().__init__()
        from transformers.activations import ACT2FN

        column = dict(mega, bias=config.mlp_bias, gather_output=False)
        self.gate_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size, **column)
        self.up_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size, **column)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, **mega,
                                           bias=config.mlp_bias, input_is_parallel=True, skip_bias_add=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)[0]) * self.up_proj(x)[0])[0]


class DecoderLayer(nn.Module):
    def __init__(self, config, heads: Heads, mega: dict):
        super().__init__()
        dtype = mega["config"].params_dtype
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = ParallelAttention(config, heads, mega)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = ParallelMLP(config, mega)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """HF's ``model.`` prefix: embedding, layers, final norm."""

    def __init__(self, config, heads: Heads, mega: dict, tp: int):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.embed_tokens = VocabParallelEmbedding(padded_vocab(config.vocab_size, tp), config.hidden_size,
                                                   **mega)
        self.layers = nn.ModuleList(DecoderLayer(config, heads, mega)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, mega["config"].params_dtype)
        # HF's own rotary tables (no weights): every rope_type HF knows (llama3, yarn, ...) comes with it.
        self.rotary_emb = LlamaRotaryEmbedding(config)


class TensorParallelLlama(nn.Module):
    """LlamaForCausalLM split over the current megatron TP group; forward gives this rank's logits."""

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r}: only {SUPPORTED_MODEL_TYPES} are supported")
        self.config = config
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.heads = Heads(config, self.tp)
        mega = layer_kwargs(self.tp, dtype, self.tp_group)
        self.model = Decoder(config, self.heads, mega, self.tp)
        self.tied = bool(config.tie_word_embeddings)
        # Tied: no weight of its own, the embedding's vocab shard is passed in at forward.
        self.lm_head = ColumnParallelLinear(config.hidden_size, padded_vocab(config.vocab_size, self.tp),
                                            **mega, bias=False, gather_output=False,
                                            skip_weight_param_allocation=self.tied)
        # Logits of padding rows (vocabulary not divisible by TP) must not enter the softmax.
        per_rank = padded_vocab(config.vocab_size, self.tp) // self.tp
        valid = max(0, min(per_rank, config.vocab_size - self.tp_rank * per_rank))
        self.register_buffer("vocab_padding", torch.arange(per_rank) >= valid, persistent=False)
        self.has_vocab_padding = valid < per_rank
        self.shards = {name: self._shard_of(name) for name, _ in self.named_parameters()}
        self.kv_replica_group = self._kv_replica_group()

    def _shard_of(self, name: str) -> Shard:
        module, kind = name.rsplit(".", 2)[-2:]
        if module in ("embed_tokens", "lm_head"):
            return Shard(0, vocab_rows=self.config.vocab_size)
        if module in ("k_proj", "v_proj"):
            return Shard(0, head_repeat=self.heads.kv_repeat, head_size=self.heads.head_dim)
        if module in ("q_proj", "gate_proj", "up_proj"):
            return Shard(0)
        if module in ("o_proj", "down_proj"):
            # The row-parallel bias is added after the all-reduce: whole on every rank.
            return Shard(1) if kind == "weight" else Shard(None)
        if module.endswith("norm"):
            return Shard(None)
        raise ValueError(f"no sharding rule for parameter {name}")

    def _kv_replica_group(self):
        """The ranks holding the same KV head as this one (None when heads are not copied)."""
        repeat = self.heads.kv_repeat
        if repeat == 1:
            return None
        if repeat == self.tp:
            return self.tp_group
        ranks = torch.distributed.get_process_group_ranks(self.tp_group)
        mine = None
        # new_group is collective: every rank creates every group, in the same order.
        for start in range(0, self.tp, repeat):
            group = torch.distributed.new_group(ranks[start:start + repeat])
            if start <= self.tp_rank < start + repeat:
                mine = group
        return mine

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for this rank's vocabulary slice, [batch, seq, padded_vocab / tp]."""
        _, s = input_ids.shape
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(s, device=input_ids.device).unsqueeze(0)
        cos, sin = self.model.rotary_emb(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
            mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        x = self.model.norm(x)
        weight = self.model.embed_tokens.weight if self.tied else None
        logits = self.lm_head(x, weight=weight)[0]
        if self.has_vocab_padding:
            logits = logits.masked_fill(self.vocab_padding, torch.finfo(logits.dtype).min)
        return logits

    @torch.no_grad()
    def full_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """All ranks' logits side by side, cut to the real vocabulary (evaluation only: no backward).

        Not megatron's gather_from_tensor_model_parallel_region: it allocates on CUDA.
        """
        pieces = [torch.empty_like(local_logits) for _ in range(self.tp)]
        torch.distributed.all_gather(pieces, local_logits.contiguous(), group=self.tp_group)
        return torch.cat(pieces, dim=-1)[..., : self.config.vocab_size]
