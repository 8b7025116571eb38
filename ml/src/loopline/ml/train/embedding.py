"""ScalarLM's ``training_mode: "embedding"``: a pooling model trained on sentence pairs.

Each line of dataset.jsonlines is ``{"sentence1": str, "sentence2": str, "score": number}``. Both
sentences are embedded exactly as vLLM embeds a text for ``/v1/embeddings``: tokenized with the
tokenizer's special tokens, run through the bare model (no pretraining head, no BERT pooler layer:
vLLM loads neither), pooled as vLLM pools the model (CLS for BERT-like encoders, the last token for
decoders) and normalised. The loss pulls each pair's cosine similarity toward its score: the squared
error, as sentence-transformers' CosineSimilarityLoss (the loss ScalarLM's embedding mode takes
scores for), averaged over the step's pairs.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.contracts.train_params import TOKENFORMER_TARGET_MODULES, JobConfig
from loopline.common.contracts.training_archive import SCORE_FIELD, TEXT_FIELDS

from .loop import Objective, StepResult, apply_update

FIRST, SECOND = TEXT_FIELDS["embedding"]
# The linear layers of a BERT-like encoder (query, key, value: vLLM packs them into qkv_proj and
# takes a LoRA or Tokenformer on each slice; dense: the attention output and both MLP layers),
# beside the decoder names for decoder embedders: a Tokenformer's default targets in embedding mode.
ENCODER_LINEAR_LAYERS = ("query", "key", "value", "dense")
EMBEDDING_TOKENFORMER_TARGETS = (*TOKENFORMER_TARGET_MODULES, *ENCODER_LINEAR_LAYERS)
# Model types vLLM pools by their first token (its BertEmbeddingModel and RobertaEmbeddingModel
# default to CLS); others (decoders run as embedders) by their last.
CLS_POOLED_TYPES = frozenset({"bert", "roberta", "xlm-roberta"})


@dataclass(frozen=True)
class Pair:
    first: list[int]
    second: list[int]
    score: float


@dataclass
class PairBatch:
    input_ids: torch.Tensor  # [2b, t]: the b first sentences, then the b second ones
    attention_mask: torch.Tensor  # [2b, t], 0 on padding
    scores: torch.Tensor  # [b]

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())


def read_pairs(path: Path) -> list[dict]:
    """The rows of dataset.jsonlines, checked as the gateway checks them (training_archive.py), so a
    dataset written by hand fails here with its line number rather than inside a step."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            score = row.get(SCORE_FIELD) if isinstance(row, dict) else None
            if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in (FIRST, SECOND)) \
                    or isinstance(score, bool) or not isinstance(score, (int, float)) or not -1 <= score <= 1:
                raise ValueError(f'{path.name} line {number}: expected {{"{FIRST}": str, "{SECOND}": str, '
                                 f'"{SCORE_FIELD}": number in [-1, 1]}}')
            rows.append(row)
    if not rows:
        raise ValueError(f"{path.name} holds no sentence pairs")
    return rows


def tokenize_pair(tokenizer, row: dict, max_seq_len: int) -> Pair:
    """Each sentence as vLLM tokenizes an embedding input (special tokens added); cut at the end."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=True)[:max_seq_len]

    return Pair(ids(row[FIRST]), ids(row[SECOND]), float(row[SCORE_FIELD]))


def collate_pairs(pairs: list[Pair], pad_id: int) -> PairBatch:
    """Both sentences of every pair in one right-padded batch: one forward pass per micro-batch."""
    sequences = [p.first for p in pairs] + [p.second for p in pairs]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return PairBatch(ids, mask, torch.tensor([p.score for p in pairs], dtype=torch.float32))


def pooling_of(model_config) -> str:
    """How vLLM pools this model for embeddings: "CLS" (the first token) or "LAST"."""
    return "CLS" if getattr(model_config, "model_type", None) in CLS_POOLED_TYPES else "LAST"


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """One normalised vector per sequence of right-padded ``hidden`` [n, t, d], as vLLM's embedding
    pooler gives it (its pooling, then its default activation for embeddings, L2 normalisation)."""
    if pooling == "CLS":
        vectors = hidden[:, 0]
    else:
        last = attention_mask.sum(dim=1) - 1
        vectors = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return F.normalize(vectors.float(), dim=-1)


def embed(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
          pooling: str) -> torch.Tensor:
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return pool(hidden, attention_mask, pooling)


def cosine_errors(embeddings: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Squared error of each pair's cosine similarity to its score; ``embeddings`` [2b, d] holds the
    b first sentences then the b second ones, normalised (so the cosine is their dot product)."""
    first, second = embeddings.chunk(2)
    return ((first * second).sum(dim=-1) - scores) ** 2


def pair_train_step(model: nn.Module, batches: list[PairBatch], optimizer, params: list[nn.Parameter],
                    clip: float, device: torch.device, *, pooling: str) -> StepResult:
    """One optimizer step over the micro-batches: the mean squared cosine error over its pairs."""
    pairs = sum(len(b.scores) for b in batches)
    total = 0.0
    for b in batches:
        embeddings = embed(model, b.input_ids.to(device), b.attention_mask.to(device), pooling)
        error_sum = cosine_errors(embeddings, b.scores.to(device)).sum()
        (error_sum / pairs).backward()
        total += error_sum.item()
    loss = total / pairs if pairs else math.nan
    return apply_update(optimizer, params, clip, loss, sum(b.tokens for b in batches))


def load_embedding_model(model_path: str, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """The bare model as vLLM runs it for embeddings: transformers' AutoModel (no head), without
    BERT's pooler layer, which vLLM does not load (it pools the last hidden state itself). Without
    it, too, PEFT's "all-linear" wraps only layers vLLM takes an adapter on."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_path, dtype=dtype)
    model.to(device)
    if isinstance(getattr(model, "pooler", None), nn.Module):
        model.pooler = None  # BertModel.forward skips a None pooler
    return model


def embedding_objective(config: JobConfig, job_dir: Path, device: torch.device,
                        dtype: torch.dtype) -> Objective:
    """The model, its tokenized pairs and the pair loss, for the training loop (loop.py)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    model = load_embedding_model(config.model_path, device, dtype)
    # Padded positions are masked out, so any id would do; the tokenizer's own, else the model's.
    pad_id: int = next((i for i in (tokenizer.pad_token_id, model.config.pad_token_id) if i is not None), 0)
    max_len = (config.params.max_seq_len if config.params.max_seq_len is not None
               else getattr(model.config, "max_position_embeddings", 512))
    pairs = [tokenize_pair(tokenizer, row, max_len) for row in read_pairs(job_dir / DATASET_FILE)]
    tokenformer = config.params.tokenformer_config
    targets = (tokenformer.target_modules if "target_modules" in tokenformer.model_fields_set
               else list(EMBEDDING_TOKENFORMER_TARGETS))
    return Objective(model, pairs, lambda micro: collate_pairs(micro, pad_id),
                     functools.partial(pair_train_step, pooling=pooling_of(model.config)),
                     "FEATURE_EXTRACTION", targets)
