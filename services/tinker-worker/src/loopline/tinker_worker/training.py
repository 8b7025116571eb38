"""The session worker's compute: one base model resident, and on it many Tinker training clients,
each a LoRA adapter with its own AdamW optimizer and step count (multi-tenant).

A client's gradients accumulate over its ``forward_backward`` calls until its ``optim_step``;
clients never share a parameter, so interleaving two clients' calls never mixes their gradients.
One lock serialises the calls: the active adapter is state of the shared model.
"""

from __future__ import annotations

import math
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tinker import types as tt
from torch import nn
from torch.nn import functional as F

from loopline.common.contracts.tinker_names import model_key
from loopline.common.contracts.tinker_schemas import LoraSpec
from loopline.ml.adapters.io import read_tensors, write_adapter

from . import adapter_files, lora_layers
from .batching import build, default_micro_batch_tokens, micro_batches, width_of
from .losses import Loss, check_data, resolve, without_gradient
from .types import PassResult, UserError


class ResidentBase:
    """A Hugging Face causal LM loaded once from a folder, float32, frozen, in eval mode (no
    dropout: a forward pass gives the same log-probabilities as sampling would)."""

    def __init__(self, path: str | Path, device: str | None = None):
        from transformers import AutoModelForCausalLM

        self.path = str(path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32, device_map=self.device)
        model.eval().requires_grad_(False)
        self.model = model
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_tokens: int | None = getattr(model.config, "max_position_embeddings", None)


@dataclass
class Client:
    adapter: str  # its name inside the wrapped layers
    spec: LoraSpec
    targets: list[str]  # module names it adapts (PEFT's resolved target_modules)
    names: list[str]  # its tensors' saved names, in the optimizer's order
    params: list[nn.Parameter]
    optimizer: torch.optim.AdamW
    steps: int = 0


MAX_CLIENTS_SETTING = "LOOPLINE_TINKER_MAX_CLIENTS"


class TrainingClients:
    def __init__(self, base: ResidentBase | str | Path, *, micro_batch_tokens: int | None = None,
                 max_clients: int | None = None):
        self.base = base if isinstance(base, ResidentBase) else ResidentBase(base)
        self.layers = lora_layers.wrap_targets(self.base.model)
        self.micro_batch_tokens = micro_batch_tokens or default_micro_batch_tokens(self.base.vocab_size)
        self.max_clients = max_clients  # None: as many as memory holds
        self._clients: dict[str, Client] = {}
        self._lock = threading.Lock()

    # --- clients ---------------------------------------------------------------------------------
    def models(self) -> list[str]:
        return list(self._clients)

    def step_count(self, model_id: str) -> int:
        return self._client(model_id).steps

    def create(self, model_id: str, lora: LoraSpec) -> None:
        """A fresh adapter (B = 0: the base model) seeded by ``lora.seed``. Creating a model that
        exists with the same LoraSpec does nothing (a redelivered create_model)."""
        with self._lock:
            existing = self._clients.get(model_id)
            if existing is not None:
                if existing.spec != lora:
                    raise UserError(f"model {model_id} exists already, with another LoRA config")
                return
            self._add(model_id, lora)

    def drop(self, model_id: str) -> None:
        with self._lock:
            client = self._clients.pop(model_id, None)
            if client is not None:
                for layer in self.layers.values():
                    layer.remove(client.adapter)

    def _add(self, model_id: str, lora: LoraSpec) -> Client:
        # Before the adapter is made: every client's LoRA and AdamW state share this process.
        if self.max_clients is not None and len(self._clients) >= self.max_clients:
            raise UserError(f"this session worker holds {len(self._clients)} training clients; the limit "
                            f"is {self.max_clients} (`{MAX_CLIENTS_SETTING}`): create it once an idle "
                            "one is released (`LOOPLINE_TINKER_IDLE_TTL_S`)")
        leaves = lora_layers.target_leaves(lora)
        paths = sorted(p for p in self.layers if p.rsplit(".", 1)[-1] in leaves)
        absent = sorted(set(leaves) - {p.rsplit(".", 1)[-1] for p in paths})
        if absent:
            raise UserError(f"the base model has no linear layers named {absent}: this LoRA config "
                            "does not fit it")
        seed = lora.seed if lora.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
        adapter = model_key(model_id)
        names: list[str] = []
        params: list[nn.Parameter] = []
        # Invariant: names and params list the A and B of paths[:k], in that order (the optimizer's
        # order, which its saved state relies on), and A's draw from one generator in path order.
        for path in paths:
            a, b = self.layers[path].add(adapter, lora.rank, generator)
            names.extend(lora_layers.peft_names(path))
            params.extend([a, b])
        client = Client(adapter, lora, sorted({p.rsplit(".", 1)[-1] for p in paths}), names, params,
                        torch.optim.AdamW(params, lr=0.0))
        self._clients[model_id] = client
        return client

    def _client(self, model_id: str) -> Client:
        client = self._clients.get(model_id)
        if client is None:
            raise UserError(f"model {model_id} is not loaded on this worker")
        return client

    # --- passes ---------------------------------------------------------------------------------
    def forward_backward(self, model_id: str, data: list[tt.Datum], loss_fn: str,
                         loss_fn_config: dict[str, Any] | None = None,
                         forward_only: bool = False) -> PassResult:
        """The loss summed over every target token of every datum; unless ``forward_only``, its
        gradient is added to the client's (which ``optim_step`` consumes)."""
        call = PassCall(model_id, data, loss_fn, loss_fn_config, forward_only)
        result = self.forward_backward_many([call])[0]
        if isinstance(result, UserError):
            raise result
        return result

    def forward_backward_many(self, calls: list[PassCall]) -> list[PassResult | UserError]:
        """Several calls, of one client or several, in shared passes over the base model: each
        micro-batch holds datums of any of them, each row through its own client's adapter. Each
        call's result is what it would be alone (within float32 rounding: a row's sums do not depend
        on the rows beside it, the matrix kernels' blocking may). A call the caller got wrong gets
        its UserError and the others go on; any other failure adds no gradient to any client (the
        SDK may send the calls again) and is raised."""
        results: list[PassResult | UserError | None] = [None] * len(calls)
        shares: list[_Share] = []
        for k, call in enumerate(calls):
            try:
                loss, config = resolve(call.loss_fn, call.loss_fn_config)
                arrays = check_data(loss, call.data, self.base.vocab_size, self.base.max_tokens)
            except UserError as exc:
                results[k] = exc
                continue
            shares.append(_Share(k, call, loss, config, arrays))
        with self._lock:
            for share in list(shares):
                try:
                    share.client = self._client(share.call.model_id)
                except UserError as exc:
                    results[share.k] = exc
                    shares.remove(share)
            # A call that fails half-way (out of memory in its third micro-batch) must add nothing:
            # the SDK may send it again. An adapter's gradients are small enough to copy.
            before = {id(s.client): (s.client, [None if p.grad is None else p.grad.clone()
                                                for p in s.client.params])
                      for s in shares if s.client is not None and not s.call.forward_only}
            try:
                # Invariant: each share's total and outputs hold its datums of the passes done so
                # far, and each client's gradients have had exactly their part added.
                for rows, backward in self._pooled_passes(shares):
                    self._pass(rows, backward)
                # A backward through datums of zero gradient would have left zeros, not None: AdamW
                # skips a parameter whose grad is None, and its momentum must still move the
                # adapter on a step whose every advantage is zero (what one process does).
                for client, _ in before.values():
                    for param in client.params:
                        if param.grad is None:
                            param.grad = torch.zeros_like(param)
            except BaseException:
                for client, grads in before.values():
                    for param, grad in zip(client.params, grads, strict=True):
                        param.grad = grad
                raise
            finally:
                lora_layers.set_active(self.layers, None)
        for share in shares:
            results[share.k] = PassResult(share.outputs, {"loss:sum": share.total})
        return [r for r in results if r is not None]

    def _passes(self, data: list[tt.Datum], arrays: list[dict[str, np.ndarray]], loss: Loss,
                forward_only: bool) -> list[tuple[list[int], bool]]:
        """One call's micro-batches and whether each needs a backward pass. Datums whose gradient
        is zero (``without_gradient``) go forward only, in batches of their own, with the same loss
        and logprobs. A forward without the graph costs about half a forward and backward: SmolLM2,
        32 datums of ~50 tokens of which 24 have zero advantages (math_rl: most groups' rewards are
        equal), 7.0-7.1 s all through backward, 4.5-4.6 s so."""
        lengths = [d.model_input.length for d in data]
        widths = [width_of(a) for a in arrays]
        inert = set(range(len(data))) if forward_only else without_gradient(loss, arrays)
        passes: list[tuple[list[int], bool]] = []
        for backward, members in ((True, [i for i in range(len(data)) if i not in inert]),
                                  (False, sorted(inert))):
            for group in micro_batches([lengths[i] for i in members], self.micro_batch_tokens,
                                       [widths[i] for i in members]):
                passes.append(([members[j] for j in group], backward))
        return passes

    def _pooled_passes(self, shares: list[_Share]) -> list[tuple[list[tuple[_Share, int]], bool]]:
        """Every datum of every share in micro-batches, and whether each needs a backward pass
        (``_passes``: datums whose gradient is zero go forward only); a micro-batch's rows are
        grouped by share, in the shares' order."""
        items: dict[bool, list[tuple[_Share, int]]] = {True: [], False: []}
        for share in shares:
            for indices, backward in self._passes(share.call.data, share.arrays, share.loss,
                                                  share.call.forward_only):
                items[backward].extend((share, i) for i in indices)
        order = {id(s): n for n, s in enumerate(shares)}
        passes: list[tuple[list[tuple[_Share, int]], bool]] = []
        for backward in (True, False):
            pool = items[backward]
            lengths = [share.call.data[i].model_input.length for share, i in pool]
            widths = [width_of(share.arrays[i]) for share, i in pool]
            for group in micro_batches(lengths, self.micro_batch_tokens, widths):
                rows = sorted((pool[j] for j in group), key=lambda item: order[id(item[0])])
                passes.append((rows, backward))
        return passes

    def _pass(self, rows: list[tuple[_Share, int]], backward: bool) -> None:
        """One forward (and backward) of rows of one or several shares."""
        spans: list[tuple[_Share, list[int]]] = []
        for share, i in rows:
            if spans and spans[-1][0] is share:
                spans[-1][1].append(i)
            else:
                spans.append((share, [i]))
        batches = [build(indices, share.call.data, share.arrays, share.loss, share.config, self.base.device)
                   for share, indices in spans]
        width = max(b.input_ids.shape[1] for b in batches)
        ids = torch.cat([F.pad(b.input_ids, (0, width - b.input_ids.shape[1])) for b in batches])
        mask = torch.cat([F.pad(b.attention_mask, (0, width - b.attention_mask.shape[1])) for b in batches])
        starts = np.cumsum([0] + [b.input_ids.shape[0] for b in batches]).tolist()
        clients = [share.client for share, _ in spans]
        assert all(c is not None for c in clients)
        lora_layers.set_rows(self.layers, [(c.adapter, starts[n], starts[n + 1])  # type: ignore[union-attr]
                                           for n, c in enumerate(clients)])
        with torch.set_grad_enabled(backward):
            logits = self.base.model(input_ids=ids, attention_mask=mask).logits
            sums = []
            for n, ((share, _), batch) in enumerate(zip(spans, batches, strict=True)):
                part = logits[starts[n]:starts[n + 1], :batch.input_ids.shape[1]]
                logprobs, summed = _loss_of(part, batch, share)
                sums.append(summed)
                share.total += float(summed.detach())
                _keep_outputs(share, batch, logprobs)
            if backward:
                torch.stack(sums).sum().backward()

    def optim_step(self, model_id: str, params: tt.AdamParams) -> dict[str, float]:
        """One AdamW step on the gradients accumulated since the last, then clears them."""
        _check_adam(params)
        with self._lock:
            client = self._client(model_id)
            # clip_grad_norm_ returns the norm before clipping; max_norm=inf only measures it.
            max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else math.inf
            norm = float(torch.nn.utils.clip_grad_norm_(client.params, max_norm))
            for group in client.optimizer.param_groups:
                group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                             weight_decay=params.weight_decay)
            client.optimizer.step()
            client.optimizer.zero_grad(set_to_none=True)
            client.steps += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": params.learning_rate}

    # --- saves -----------------------------------------------------------------------------------
    def save_adapter(self, model_id: str, out_dir: Path, base_model: str) -> None:
        """Our adapter format (a PEFT LoRA folder) into the existing empty ``out_dir``."""
        with self._lock:
            client = self._client(model_id)
            tensors = lora_layers.tensor_dict(self.layers, client.adapter)
        write_adapter(Path(out_dir), adapter_files.adapter_config(client.spec, client.targets, base_model),
                      tensors)

    def save_state(self, model_id: str, out_dir: Path) -> None:
        """The adapter, its LoraSpec, and the optimizer's state and step count."""
        out_dir = Path(out_dir)
        self.save_adapter(model_id, out_dir, self.base.path)
        with self._lock:
            client = self._client(model_id)
            adapter_files.write_spec(out_dir, client.spec)
            adapter_files.write_optimizer(out_dir, client.optimizer, client.steps, client.names)

    def load_state(self, model_id: str, folder: Path, with_optimizer: bool,
                   lora: LoraSpec | None = None) -> None:
        """Load a save into the model, creating it if absent (with the checkpoint's own LoraSpec,
        else ``lora``). Without the optimizer, AdamW starts afresh and the step count stays (0 for
        a new model); with it, both are the checkpoint's. Pending gradients are dropped."""
        folder = Path(folder)
        spec = adapter_files.read_spec(folder) if folder.is_dir() else lora
        if spec is None or not folder.is_dir():
            raise UserError(f"no checkpoint folder {folder.name}")
        tensors = read_tensors(folder)
        with self._lock:
            client = self._clients.get(model_id)
            created = client is None
            if client is None:
                client = self._add(model_id, spec)
            elif (client.spec.rank, lora_layers.target_leaves(client.spec)) != (
                    spec.rank, lora_layers.target_leaves(spec)):
                raise UserError(f"the checkpoint is a rank-{spec.rank} LoRA of other modules than model "
                                f"{model_id} (rank {client.spec.rank}): it cannot be loaded into it")
            try:
                # Everything is read and checked before the model changes: a refused load leaves it as
                # it was.
                saved = adapter_files.read_optimizer(folder, client.names) if with_optimizer else None
                lora_layers.load_tensors(self.layers, client.adapter, tensors)
                client.optimizer = torch.optim.AdamW(client.params, lr=0.0)
                if saved is not None:
                    client.optimizer.load_state_dict(saved[0])
                    client.steps = saved[1]
                for param in client.params:
                    param.grad = None
            except BaseException:
                if created:  # a model made for this load does not outlive its failure
                    self._clients.pop(model_id, None)
                    for layer in self.layers.values():
                        layer.remove(client.adapter)
                raise


def _check_adam(params: tt.AdamParams) -> None:
    values = {"learning_rate": params.learning_rate, "beta1": params.beta1, "beta2": params.beta2,
              "eps": params.eps, "weight_decay": params.weight_decay, "grad_clip_norm": params.grad_clip_norm}
    bad = [k for k, v in values.items() if not math.isfinite(v) or v < 0]
    if bad or params.beta1 >= 1 or params.beta2 >= 1:
        raise UserError(f"adam_params: {bad or ['beta1', 'beta2']} out of range (all finite, >= 0; "
                        "betas < 1)")


@dataclass
class PassCall:
    """One forward_backward call's arguments."""

    model_id: str
    data: list[tt.Datum]
    loss_fn: str
    loss_fn_config: dict[str, Any] | None = None
    forward_only: bool = False


@dataclass
class _Share:
    """One call's part of a pooled forward_backward, and what it has added up so far."""

    k: int  # its position among the calls
    call: PassCall
    loss: Loss
    config: dict[str, float]
    arrays: list[dict[str, np.ndarray]]
    client: Client | None = None
    total: float = 0.0
    outputs: list[dict[str, np.ndarray]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.outputs = [{} for _ in self.call.data]


def _loss_of(logits: torch.Tensor, batch: Any, share: _Share) -> tuple[torch.Tensor, torch.Tensor]:
    """A share's rows' logprobs of their targets and their summed loss."""
    real = batch.real
    if batch.soft:  # (b, T, K): the logprob of each of K candidate tokens
        logprobs = logits.log_softmax(-1).gather(-1, batch.targets)
        real = real.unsqueeze(-1)
    else:
        logprobs = -F.cross_entropy(logits.transpose(1, 2), batch.targets, reduction="none")
    per_token = share.loss.per_token(logprobs, batch.inputs, share.config)
    return logprobs, torch.where(real, per_token, 0.0).sum()


def _keep_outputs(share: _Share, batch: Any, logprobs: torch.Tensor) -> None:
    rows = logprobs.detach().float().cpu().numpy()
    for row, (i, n, w) in enumerate(zip(batch.indices, batch.lengths, batch.widths, strict=True)):
        out = rows[row, :n]
        if batch.soft:  # each datum's logprobs have its own target_tokens' shape
            out = out[:, :w] if w is not None else out[:, 0]
        share.outputs[i] = {"logprobs": out.copy()}
