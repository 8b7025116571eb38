"""Embedding training (training_mode "embedding", loopline.ml.train.embedding): the pairs' data, the
pooling and loss, and the training program pulling the tiny embedder's cosines toward the scores."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

import pytest
import torch

from loopline.common.contracts.job_hash import job_hash
from loopline.common.contracts.job_layout import DATASET_FILE
from loopline.common.contracts.train_params import JobConfig, TrainParams, canonical
from loopline.ml.adapters.io import apply_adapter, prepare_model, read_adapter_config
from loopline.ml.models.resolve import resolve_model
from loopline.ml.train.__main__ import run_program
from loopline.ml.train.checkpoint import latest_checkpoint
from loopline.ml.train.embedding import (
    collate_pairs,
    cosine_errors,
    embed,
    load_embedding_model,
    pair_train_step,
    pool,
    pooling_of,
    read_pairs,
    tokenize_pair,
)
from support.stacks import MODELS_DIR

PAIRS = [
    ("A man is playing a guitar.", "A person plays music on a guitar.", 0.9),
    ("A cat sleeps on the sofa.", "The stock market fell sharply today.", 0.0),
    ("Children are playing in the park.", "Kids play outside in a park.", 0.8),
    ("The chef is cooking pasta.", "A rocket launched into space.", 0.1),
    ("She is reading a book.", "A woman reads a novel.", 0.7),
    ("It is raining heavily.", "The weather is sunny and dry.", 0.3),
]
ROWS = [{"sentence1": a, "sentence2": b, "score": s} for a, b, s in PAIRS]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def embed_path() -> str:
    return str(resolve_model("tiny-embed", MODELS_DIR))


@pytest.fixture(scope="module")
def tokenizer(embed_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embed_path)


def train(job_dir: Path) -> int:
    """The program's entry in this process, the SIGTERM handler it installs put back afterwards."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        return run_program(job_dir)
    finally:
        signal.signal(signal.SIGTERM, handler)


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("row", [
    {"sentence1": "a", "sentence2": "b"},
    {"sentence1": "a", "sentence2": 3, "score": 0.5},
    {"sentence1": "a", "sentence2": "b", "score": True},
    {"sentence1": "a", "sentence2": "b", "score": 1.5},
    ["a", "b", 0.5],
])
def test_a_row_that_is_not_a_scored_pair_is_refused_with_its_line(tmp_path, row):
    with pytest.raises(ValueError, match="line 2: expected"):
        read_pairs(write_rows(tmp_path / DATASET_FILE, [ROWS[0], row]))


def test_pairs_are_tokenized_as_vllm_tokenizes_an_embedding_input(tokenizer, tmp_path):
    rows = read_pairs(write_rows(tmp_path / DATASET_FILE, ROWS[:2]))
    pair = tokenize_pair(tokenizer, rows[0], max_seq_len=512)
    assert pair.first == tokenizer.encode(PAIRS[0][0], add_special_tokens=True)  # /v1/embeddings' default
    assert pair.first[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # the token CLS pooling reads
    assert pair.score == 0.9
    assert len(tokenize_pair(tokenizer, rows[0], max_seq_len=3).second) == 3


def test_collate_puts_first_sentences_then_second_ones_right_padded(tokenizer):
    pairs = [tokenize_pair(tokenizer, r, 512) for r in ROWS[:2]]
    batch = collate_pairs(pairs, pad_id=0)
    assert batch.input_ids.shape[0] == 4 and batch.scores.tolist() == pytest.approx([0.9, 0.0])
    for row, sequence in enumerate([pairs[0].first, pairs[1].first, pairs[0].second, pairs[1].second]):
        n = len(sequence)
        assert batch.input_ids[row, :n].tolist() == sequence and batch.attention_mask[row].sum() == n
    assert batch.tokens == sum(len(p.first) + len(p.second) for p in pairs)


def test_pooling_reads_the_first_or_the_last_real_token_and_normalises():
    hidden = torch.tensor([[[3.0, 4.0], [1.0, 0.0], [9.0, 9.0]]])  # the last position is padding
    mask = torch.tensor([[1, 1, 0]])
    assert torch.allclose(pool(hidden, mask, "CLS"), torch.tensor([[0.6, 0.8]]))
    assert torch.allclose(pool(hidden, mask, "LAST"), torch.tensor([[1.0, 0.0]]))


def test_bert_is_cls_pooled_and_a_decoder_last_token_pooled(embed_path):
    from transformers import AutoConfig, LlamaConfig

    assert pooling_of(AutoConfig.from_pretrained(embed_path)) == "CLS"  # vLLM's BertEmbeddingModel
    assert pooling_of(LlamaConfig()) == "LAST"


def test_the_loss_is_each_pairs_squared_cosine_error():
    first = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    second = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # cosines 1 and 0
    errors = cosine_errors(torch.cat([first, second]), torch.tensor([0.5, -0.5]))
    assert errors.tolist() == [0.25, 0.25]


def test_a_step_trains_only_the_lora_and_reports_the_mean_error(embed_path, tokenizer):
    lora = {"r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "target_modules": "all-linear"}
    model, _ = prepare_model(load_embedding_model(embed_path, CPU, torch.float32), "lora", tokenformer={},
                             lora=lora, base_model=embed_path, seed=0, lora_task_type="FEATURE_EXTRACTION")
    # PEFT's all-linear on the bare BERT: every encoder layer's linear layers, no pooler (vLLM has none).
    targets = model.peft_config["default"].target_modules
    assert {t.rsplit(".", 1)[-1] for t in targets} == {"query", "key", "value", "dense"}
    assert not any("pooler" in t for t in targets)
    batch = collate_pairs([tokenize_pair(tokenizer, r, 512) for r in ROWS], pad_id=0)
    with torch.no_grad():
        expected = float(cosine_errors(embed(model, batch.input_ids, batch.attention_mask, "CLS"),
                                       batch.scores).mean())
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = [p.detach().clone() for p in trainable]
    result = pair_train_step(model, [batch], torch.optim.AdamW(trainable, lr=1e-2), trainable, 1.0, CPU,
                             pooling="CLS")
    assert result.applied and result.loss == pytest.approx(expected, rel=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainable, strict=True))
    assert all(torch.equal(frozen[n], p) for n, p in model.named_parameters() if n in frozen)


def test_the_training_program_pulls_the_cosines_toward_the_scores(embed_path, tokenizer, tmp_path):
    """The e2e test's recipe (tests/e2e/test_embedding_training.py), through the program's entry."""
    params = TrainParams(training_mode="embedding", adapter_type="lora", max_steps=150, learning_rate=5e-3,
                         batch_size=len(PAIRS), gradient_accumulation_steps=1)
    data = write_rows(tmp_path / DATASET_FILE, ROWS).read_bytes()
    JobConfig(job_hash=job_hash(canonical(params), hashlib.sha256(data).hexdigest()), model_path=embed_path,
              params=params).write(tmp_path)
    assert train(tmp_path) == 0

    batch = collate_pairs([tokenize_pair(tokenizer, r, 512) for r in ROWS], pad_id=0)

    def mean_abs_error(model) -> float:
        with torch.no_grad():
            first, second = embed(model.eval(), batch.input_ids, batch.attention_mask, "CLS").chunk(2)
        return float(((first * second).sum(dim=-1) - batch.scores).abs().mean())

    before = mean_abs_error(load_embedding_model(embed_path, CPU, torch.float32))
    _, checkpoint = latest_checkpoint(tmp_path)
    after = mean_abs_error(apply_adapter(load_embedding_model(embed_path, CPU, torch.float32), checkpoint))
    assert before > 0.5 and after < 0.5 * before, (before, after)  # measured: 0.533 -> 0.108
    config = read_adapter_config(checkpoint)
    assert config["task_type"] == "FEATURE_EXTRACTION" and config["peft_type"] == "LORA"


def test_embedding_mode_tokenformer_wraps_the_encoders_linear_layers(embed_path, tmp_path):
    params = TrainParams(training_mode="embedding", adapter_type="tokenformer", max_steps=2,
                         batch_size=2, gradient_accumulation_steps=1)
    data = write_rows(tmp_path / DATASET_FILE, ROWS).read_bytes()
    JobConfig(job_hash=job_hash(canonical(params), hashlib.sha256(data).hexdigest()), model_path=embed_path,
              params=params).write(tmp_path)
    assert train(tmp_path) == 0
    _, checkpoint = latest_checkpoint(tmp_path)
    config = read_adapter_config(checkpoint)
    assert config["target_modules"] == ["dense", "key", "query", "value"]


def test_embedding_mode_is_refused_with_tensor_parallel():
    with pytest.raises(ValueError, match="training_mode 'embedding' trains in one process"):
        TrainParams(training_mode="embedding", tensor_parallel=2, adapter_type="none")
    assert TrainParams(training_mode="EMBEDDING").training_mode == "embedding"
